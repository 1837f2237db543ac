#include "kv_cache/kv_cache_bindings.h"

#include <string>

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "kv_cache/block_manager.h"
#include "kv_cache/pool_alloc.h"

namespace py = pybind11;

namespace fastllm {

void bind_kv_cache(py::module_& m) {
  m.def(
      "zeros_huge_pages",
      [](std::vector<int64_t> sizes, at::ScalarType dtype) {
        return zeros_huge_pages(sizes, dtype);
      },
      py::arg("sizes"), py::arg("dtype"),
      "A zero-filled CPU tensor in 2 MiB-aligned memory advised for transparent huge pages "
      "(the paged KV pools, read scattered, and the weight blocks a decode step streams: 4 KiB "
      "pages make both TLB-bound).");
  auto& full_error =
      py::register_local_exception<KVCacheFullError>(m, "KVCacheFullError", PyExc_RuntimeError);
  full_error.attr("__doc__") =
      "The KV pool has too few free and evictable blocks for a request. A RuntimeError; the "
      "BlockManager that raised it is left exactly as it was before the call.";

  py::class_<BlockManager>(m, "BlockManager", R"doc(
Hands out the blocks of paged K/V pools ``[num_blocks, block_size, n_kv_heads, head_dim]`` to
sequences; the pools are tensors owned elsewhere (``fastllm.kv_cache.PagedKVCache``).

Prefix caching (vLLM's): a full block is cached under its tokens chained onto the prefix before
it; a new prompt reuses the longest cached run of full blocks. Lookups compare the cached tokens
and prefix exactly, so a hash collision is a miss, never another prompt's KV. A full block enters
the cache once ``mark_computed`` says its KV is written, never before.

A block is free, referenced (ref count > 0) or evictable (cached, unreferenced). New blocks come
from the free list, then from the least recently used evictable block, which leaves the cache.
A freed sequence's blocks become evictable last block first, so a shared prefix outlives its
continuations.

Out of blocks, ``allocate`` / ``append_tokens`` raise ``KVCacheFullError`` and change nothing.
Unknown or duplicate sequence ids and negative token ids raise ValueError. Not thread-safe.)doc")
      .def(py::init<int64_t, int64_t, bool>(), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("enable_prefix_caching") = true)
      .def("allocate", &BlockManager::allocate, py::arg("seq_id"), py::arg("token_ids"),
           py::arg("reuse_cached") = true, py::arg("cache_salt") = 0, R"doc(
Registers sequence ``seq_id`` holding the prompt ``token_ids`` in ceil(len / block_size) blocks.

Returns how many leading prompt tokens already have their KV in the pools (reused cached
blocks): a multiple of block_size, capped at the largest one <= len - 1 so that at least the
last token is computed and yields logits. The caller computes the tokens from there on.
``reuse_cached=False`` reuses none (a caller that needs every prompt token's logits); the
sequence's blocks still enter the prefix cache as they are computed. Blocks are shared only
between sequences of the same ``cache_salt`` (an int >= 0; the engine passes the LoRA adapter's
id, so that KV computed under one adapter never serves another).)doc")
      .def("append_tokens", &BlockManager::append_tokens, py::arg("seq_id"), py::arg("token_ids"),
           py::arg("cacheable") = true, R"doc(
Extends sequence ``seq_id`` by ``token_ids`` (decoded tokens or a prefill chunk), taking new
blocks as needed.

``cacheable=False`` says the new tokens' KV is not that of a plain causal prefill (independent
chunks under block attention): from then on none of the sequence's blocks enter the prefix cache,
so no later request can mistake that KV for its own.

Returns the ``(src_block, dst_block)`` copies to perform on the pools before writing the new KV:
one when the partial last block was shared with a fork (copy-on-write), else [].)doc")
      .def("mark_computed", &BlockManager::mark_computed, py::arg("seq_id"), py::arg("num_tokens"),
           R"doc(
Says the sequence's first ``num_tokens`` tokens have their KV written in the pools (call it after
the forward step that wrote them). Only then do their full blocks enter the prefix cache, so a
block allocated for a chunk not yet run, or for a step that failed, is never reused by another
sequence. A count below the current one changes nothing; one above ``num_tokens(seq_id)`` is a
ValueError.)doc")
      .def("truncate", &BlockManager::truncate, py::arg("seq_id"), py::arg("num_tokens"),
           R"doc(
Drops the sequence's tokens from ``num_tokens`` on (speculative drafts the model rejected):
the blocks past the new end go back to the pool, and the computed count drops to
``num_tokens`` if it was above. With prefix caching, ``num_tokens`` may not cut into a block
already offered to the prefix cache (one marked computed while full): a ValueError, as is a
count above ``num_tokens(seq_id)``. Never fails for lack of blocks.)doc")
      .def("fork", &BlockManager::fork, py::arg("parent_seq_id"), py::arg("child_seq_id"),
           "Registers ``child_seq_id`` sharing all the parent's blocks (n > 1 samples).")
      .def("free", &BlockManager::free, py::arg("seq_id"),
           "Drops a sequence: its cached full blocks become evictable, the others free.")
      .def("block_table", &BlockManager::block_table, py::arg("seq_id"),
           "The sequence's block ids, in token order.")
      .def("block_tables", &BlockManager::block_tables, py::arg("seq_ids"), R"doc(
int32 ``[len(seq_ids), longest table]`` of block ids, shorter rows padded with block 0: a valid
id, never read since readers stop at each sequence's length.)doc")
      .def("num_tokens", &BlockManager::num_tokens, py::arg("seq_id"))
      .def("num_computed_tokens", &BlockManager::num_computed_tokens, py::arg("seq_id"),
           "Leading tokens whose KV is written (prefix-cache hits and ``mark_computed``).")
      .def("reset_prefix_cache", &BlockManager::reset_prefix_cache,
           "Drops every cached block no sequence holds (a later prompt computes its KV again, "
           "as after new weights); returns how many. Blocks sequences hold stay cached.")
      .def("record_cache_events", &BlockManager::record_cache_events, py::arg("on"),
           "Starts (or stops) recording the prefix cache's changes for take_cache_events.")
      .def(
          "take_cache_events",
          [](BlockManager& self) {
            py::list events;
            for (const auto& event : self.take_cache_events())
              events.append(py::make_tuple(event.stored, event.prefix_id, event.parent_prefix_id,
                                           event.token_ids));
            return events;
          },
          R"doc(
The prefix cache's changes since the last call, oldest first, each ``(stored, prefix_id,
parent_prefix_id, token_ids)``: a full block cached (``stored``) as the prefix ``prefix_id``,
chained onto ``parent_prefix_id`` (0 for a first block, ``2**63 | cache_salt`` for a first
block of a salted chain) with its ``token_ids``; or the cached prefix ``prefix_id`` forgotten
(evicted, reset, re-keyed). Recorded only after ``record_cache_events(True)``.)doc")
      .def("can_allocate", &BlockManager::can_allocate, py::arg("num_tokens"),
           "Whether a prompt of ``num_tokens`` fits in free and evictable blocks, with no "
           "prefix-cache hit counted.")
      .def("ref_count", &BlockManager::ref_count, py::arg("block_id"),
           "How many sequences hold the block; for tests and debugging.")
      .def(
          "stats",
          [](const BlockManager& self) {
            const BlockManagerStats stats = self.stats();
            py::dict out;
            out["hits"] = stats.hits;
            out["queries"] = stats.queries;
            out["cached_blocks"] = stats.cached_blocks;
            out["referenced_blocks"] = stats.referenced_blocks;
            out["evictable_blocks"] = stats.evictable_blocks;
            out["free_blocks"] = stats.free_blocks;
            return out;
          },
          R"doc(
Counters, all in blocks: ``hits`` / ``queries`` are prompt blocks reused / looked up by
``allocate`` (looked up: the full blocks under the reuse cap); ``cached_blocks`` are in the
prefix cache, referenced or not; ``referenced_blocks + evictable_blocks + free_blocks`` is
``num_blocks``.)doc")
      .def_property_readonly("num_free_blocks", &BlockManager::num_free_blocks,
                             "Blocks available for new KV: the free list plus evictable ones.")
      .def_property_readonly("usage", &BlockManager::usage, "Fraction of blocks referenced.")
      .def_property_readonly("num_blocks", &BlockManager::num_blocks)
      .def_property_readonly("block_size", &BlockManager::block_size)
      .def_property_readonly("enable_prefix_caching", &BlockManager::enable_prefix_caching)
      .def("__repr__", [](const BlockManager& self) {
        return "BlockManager(num_blocks=" + std::to_string(self.num_blocks()) +
               ", block_size=" + std::to_string(self.block_size()) +
               ", enable_prefix_caching=" + (self.enable_prefix_caching() ? "True" : "False") +
               ", num_free_blocks=" + std::to_string(self.num_free_blocks()) + ")";
      });
}

}  // namespace fastllm

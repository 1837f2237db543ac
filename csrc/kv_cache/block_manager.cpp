#include "kv_cache/block_manager.h"

#include <algorithm>
#include <limits>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace fastllm {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The prefix index key of a full block: its tokens chained onto its parent's prefix.
uint64_t prefix_key(uint64_t parent_prefix_id, const int64_t* token_ids, int64_t block_size) {
  uint64_t h = splitmix64(parent_prefix_id);
  for (int64_t i = 0; i < block_size; ++i) h = splitmix64(h ^ uint64_t(token_ids[i]));
  return h;
}

void check_token_ids(const std::vector<int64_t>& token_ids, const char* op, int64_t seq_id) {
  for (size_t i = 0; i < token_ids.size(); ++i)
    TORCH_CHECK_VALUE(token_ids[i] >= 0, "BlockManager.", op, "(seq_id=", seq_id, "): token_ids[",
                      i, "] = ", token_ids[i], " is negative");
}

}  // namespace

BlockManager::BlockManager(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching)
    : block_size_(block_size), enable_prefix_caching_(enable_prefix_caching) {
  TORCH_CHECK_VALUE(num_blocks > 0 && num_blocks <= std::numeric_limits<BlockId>::max(),
                    "BlockManager num_blocks must be in [1, 2**31 - 1], got ", num_blocks);
  TORCH_CHECK_VALUE(block_size > 0, "BlockManager block_size must be positive, got ", block_size);
  blocks_.resize(num_blocks);
  for (BlockId b = BlockId(num_blocks) - 1; b >= 0; --b) free_list_.push_back(b);  // 0 on top
}

const BlockManager::Sequence& BlockManager::sequence(int64_t seq_id, const char* op) const {
  const auto it = sequences_.find(seq_id);
  TORCH_CHECK_VALUE(it != sequences_.end(), "BlockManager.", op, ": unknown sequence ", seq_id);
  return it->second;
}

BlockManager::Sequence& BlockManager::sequence(int64_t seq_id, const char* op) {
  return const_cast<Sequence&>(std::as_const(*this).sequence(seq_id, op));
}

void BlockManager::check_capacity(int64_t num_needed, int64_t num_available, const char* op,
                                  int64_t seq_id) const {
  if (num_needed <= num_available) return;
  std::ostringstream message;
  message << "KV cache full: " << op << "(seq_id=" << seq_id << ") needs " << num_needed
          << " new blocks but only " << num_available << " are free (" << free_list_.size()
          << " on the free list, " << evictable_.size() << " evictable cached, of "
          << blocks_.size() << "); free finished sequences or give the pool more blocks";
  throw KVCacheFullError(message.str());
}

BlockManager::BlockId BlockManager::find_cached(uint64_t parent_prefix_id,
                                                const int64_t* token_ids) const {
  const auto it = prefix_index_.find(prefix_key(parent_prefix_id, token_ids, block_size_));
  if (it == prefix_index_.end()) return -1;
  const Block& block = blocks_[it->second];
  const bool same = block.parent_prefix_id == parent_prefix_id &&
                    std::equal(block.token_ids.begin(), block.token_ids.end(), token_ids);
  return same ? it->second : -1;
}

// A block for new KV: from the free list, else the least recently used evictable block, which
// leaves the prefix cache. Callers check capacity first. The free list is a stack: the block
// freed last is taken first, its memory mapped and likely still in the CPU's caches; taking the
// oldest walked a fresh host pool (2 GiB by default) page by page, each page faulted in and
// zeroed by the kernel at its first write.
BlockManager::BlockId BlockManager::take_block() {
  BlockId id;
  if (!free_list_.empty()) {
    id = free_list_.back();
    free_list_.pop_back();
  } else {
    TORCH_INTERNAL_ASSERT(!evictable_.empty(), "BlockManager: no block left after the check");
    id = evictable_.front();
    evictable_.pop_front();
    uncache(id);
  }
  blocks_[id].ref_count = 1;
  return id;
}

void BlockManager::uncache(BlockId id) {
  Block& block = blocks_[id];
  if (record_cache_events_) cache_events_.push_back({false, block.prefix_id, 0, {}});
  prefix_index_.erase(block.key);
  block.cached = false;
  block.token_ids.clear();
}

int64_t BlockManager::reset_prefix_cache() {
  const auto dropped = int64_t(evictable_.size());
  for (const BlockId id : evictable_) {
    uncache(id);
    free_list_.push_back(id);
  }
  evictable_.clear();
  return dropped;
}

void BlockManager::acquire(BlockId id) {
  Block& block = blocks_[id];
  if (block.ref_count == 0) evictable_.erase(block.lru_position);
  ++block.ref_count;
}

void BlockManager::release(BlockId id) {
  Block& block = blocks_[id];
  TORCH_INTERNAL_ASSERT(block.ref_count > 0, "BlockManager: block ", id, " released twice");
  if (--block.ref_count > 0) return;
  if (block.cached)
    block.lru_position = evictable_.insert(evictable_.end(), id);
  else
    free_list_.push_back(id);
}

// A full block whose KV is written enters the prefix cache under its prefix. If that prefix is
// cached already (two sequences computed it before either was cached), the sequence's chain
// continues through the cached copy and this block stays uncached.
void BlockManager::cache_full_block(Sequence& seq, BlockId id, const int64_t* token_ids) {
  if (!enable_prefix_caching_ || seq.prefix_id == kUncachablePrefix) return;
  Block& block = blocks_[id];
  if (block.cached && block.parent_prefix_id == seq.prefix_id) {
    seq.prefix_id = block.prefix_id;  // a fork sharing the block cached it first
    return;
  }
  const uint64_t key = prefix_key(seq.prefix_id, token_ids, block_size_);
  const auto [it, inserted] = prefix_index_.try_emplace(key, id);
  if (!inserted) {
    const BlockId cached = find_cached(seq.prefix_id, token_ids);
    seq.prefix_id = cached >= 0 ? blocks_[cached].prefix_id : kUncachablePrefix;
    return;
  }
  if (block.cached) {
    // Shared with a fork that cached it under another copy of the same tokens' prefix (since
    // evicted): re-key it under this one, keeping its prefix id so blocks cached after it stay
    // reachable. Its old entry goes, so the index never holds two keys for one block.
    prefix_index_.erase(block.key);
    if (record_cache_events_) cache_events_.push_back({false, block.prefix_id, 0, {}});
  } else {
    block.cached = true;
    block.prefix_id = next_prefix_id_++;
    block.token_ids.assign(token_ids, token_ids + block_size_);
  }
  block.key = key;
  block.parent_prefix_id = seq.prefix_id;
  seq.prefix_id = block.prefix_id;
  if (record_cache_events_)
    cache_events_.push_back({true, block.prefix_id, block.parent_prefix_id, block.token_ids});
}

int64_t BlockManager::allocate(int64_t seq_id, const std::vector<int64_t>& token_ids,
                               bool reuse_cached, int64_t cache_salt) {
  TORCH_CHECK_VALUE(sequences_.count(seq_id) == 0, "BlockManager.allocate: sequence ", seq_id,
                    " already exists");
  TORCH_CHECK_VALUE(cache_salt >= 0 && cache_salt < INT64_MAX, "BlockManager.allocate(seq_id=",
                    seq_id, "): cache_salt must be in [0, 2**63 - 1), got ", cache_salt);
  check_token_ids(token_ids, "allocate", seq_id);
  const int64_t n = int64_t(token_ids.size());
  const int64_t num_full = n / block_size_;

  // Look up without touching anything, so that a full pool leaves the state as it was. The
  // caller needs the logits of the last prompt token, so at least one token is left to compute.
  const int64_t num_reusable =
      enable_prefix_caching_ && reuse_cached && n > 0 ? (n - 1) / block_size_ : 0;
  std::vector<BlockId> blocks;
  // A salted chain starts from a root of its own, above every counted prefix id (those count
  // up from 1 and never reach 2**63) and below kUncachablePrefix.
  uint64_t prefix_id =
      cache_salt == 0 ? kEmptyPrefix : (uint64_t(1) << 63) | uint64_t(cache_salt);
  int64_t num_hits_evictable = 0;  // hits that stop being available for new KV
  for (int64_t i = 0; i < num_reusable; ++i) {
    const BlockId hit = find_cached(prefix_id, token_ids.data() + i * block_size_);
    if (hit < 0) break;
    blocks.push_back(hit);
    prefix_id = blocks_[hit].prefix_id;
    num_hits_evictable += blocks_[hit].ref_count == 0;
  }
  const int64_t num_hits = int64_t(blocks.size());
  check_capacity(ceil_div(n, block_size_) - num_hits, num_free_blocks() - num_hits_evictable,
                 "allocate", seq_id);

  queries_ += num_reusable;
  hits_ += num_hits;
  for (const BlockId hit : blocks) acquire(hit);  // before take_block can evict them
  Sequence seq;
  seq.prefix_id = prefix_id;
  for (int64_t i = num_hits; i < ceil_div(n, block_size_); ++i) blocks.push_back(take_block());
  seq.blocks = std::move(blocks);
  seq.token_ids = token_ids;
  seq.num_computed = num_hits * block_size_;
  seq.num_settled_blocks = num_hits;
  sequences_.emplace(seq_id, std::move(seq));
  return num_hits * block_size_;
}

std::vector<BlockManager::BlockCopy> BlockManager::append_tokens(
    int64_t seq_id, const std::vector<int64_t>& token_ids, bool cacheable) {
  Sequence& seq = sequence(seq_id, "append_tokens");
  check_token_ids(token_ids, "append_tokens", seq_id);
  if (token_ids.empty()) return {};
  // A partial last block shared with a fork must not see this sequence's tokens: move onto a
  // fresh block holding a copy of the filled part.
  const int64_t num_tokens = int64_t(seq.token_ids.size());
  const bool copy_on_write =
      num_tokens % block_size_ != 0 && blocks_[seq.blocks.back()].ref_count > 1;
  const int64_t num_new = ceil_div(num_tokens + int64_t(token_ids.size()), block_size_) -
                          int64_t(seq.blocks.size()) + copy_on_write;
  check_capacity(num_new, num_free_blocks(), "append_tokens", seq_id);

  std::vector<BlockCopy> copies;
  if (!cacheable) seq.uncacheable_from = std::min(seq.uncacheable_from, num_tokens);
  if (copy_on_write) {
    const BlockId src = seq.blocks.back();
    const BlockId dst = take_block();
    --blocks_[src].ref_count;  // still > 0: the fork holds it
    seq.blocks.back() = dst;
    copies.emplace_back(src, dst);
  }
  for (int64_t i = num_tokens; i < num_tokens + int64_t(token_ids.size()); ++i)
    if (i % block_size_ == 0) seq.blocks.push_back(take_block());
  seq.token_ids.insert(seq.token_ids.end(), token_ids.begin(), token_ids.end());
  return copies;
}

void BlockManager::mark_computed(int64_t seq_id, int64_t num_tokens) {
  Sequence& seq = sequence(seq_id, "mark_computed");
  TORCH_CHECK_VALUE(num_tokens >= 0 && num_tokens <= int64_t(seq.token_ids.size()),
                    "BlockManager.mark_computed(seq_id=", seq_id, "): num_tokens=", num_tokens,
                    " is not in [0, ", seq.token_ids.size(), "], the tokens the sequence holds");
  if (num_tokens <= seq.num_computed) return;
  seq.num_computed = num_tokens;
  for (int64_t i = seq.num_settled_blocks; i < num_tokens / block_size_; ++i) {
    // The chain of cached blocks ends at the first block holding uncacheable KV.
    if ((i + 1) * block_size_ > seq.uncacheable_from) seq.prefix_id = kUncachablePrefix;
    cache_full_block(seq, seq.blocks[i], seq.token_ids.data() + i * block_size_);
  }
  seq.num_settled_blocks = std::max(seq.num_settled_blocks, num_tokens / block_size_);
}

void BlockManager::truncate(int64_t seq_id, int64_t num_tokens) {
  Sequence& seq = sequence(seq_id, "truncate");
  const int64_t settled = enable_prefix_caching_ ? seq.num_settled_blocks * block_size_ : 0;
  TORCH_CHECK_VALUE(num_tokens >= settled && num_tokens <= int64_t(seq.token_ids.size()),
                    "BlockManager.truncate(seq_id=", seq_id, "): num_tokens=", num_tokens,
                    " is not in [", settled, ", ", seq.token_ids.size(),
                    "] (the tokens it holds, after its blocks offered to the prefix cache)");
  const int64_t num_kept_blocks = ceil_div(num_tokens, block_size_);
  while (int64_t(seq.blocks.size()) > num_kept_blocks) {
    release(seq.blocks.back());
    seq.blocks.pop_back();
  }
  seq.token_ids.resize(num_tokens);
  seq.num_computed = std::min(seq.num_computed, num_tokens);
  seq.num_settled_blocks = std::min(seq.num_settled_blocks, num_tokens / block_size_);
}

void BlockManager::fork(int64_t parent_seq_id, int64_t child_seq_id) {
  const Sequence& parent = sequence(parent_seq_id, "fork");
  TORCH_CHECK_VALUE(sequences_.count(child_seq_id) == 0, "BlockManager.fork: sequence ",
                    child_seq_id, " already exists");
  for (const BlockId id : parent.blocks) acquire(id);
  Sequence child = parent;
  sequences_.emplace(child_seq_id, std::move(child));
}

void BlockManager::free(int64_t seq_id) {
  const Sequence& seq = sequence(seq_id, "free");
  // Last block first: a prefix outlives its continuations in the LRU order, as in vLLM.
  for (auto it = seq.blocks.rbegin(); it != seq.blocks.rend(); ++it) release(*it);
  sequences_.erase(seq_id);
}

const std::vector<BlockManager::BlockId>& BlockManager::block_table(int64_t seq_id) const {
  return sequence(seq_id, "block_table").blocks;
}

at::Tensor BlockManager::block_tables(const std::vector<int64_t>& seq_ids) const {
  std::vector<const Sequence*> seqs;
  size_t width = 0;
  for (const int64_t seq_id : seq_ids) {
    seqs.push_back(&sequence(seq_id, "block_tables"));
    width = std::max(width, seqs.back()->blocks.size());
  }
  at::Tensor tables = at::zeros({int64_t(seqs.size()), int64_t(width)}, at::kInt);
  int32_t* rows = tables.data_ptr<int32_t>();
  for (size_t i = 0; i < seqs.size(); ++i)
    std::copy(seqs[i]->blocks.begin(), seqs[i]->blocks.end(), rows + i * width);
  return tables;
}

int64_t BlockManager::num_tokens(int64_t seq_id) const {
  return int64_t(sequence(seq_id, "num_tokens").token_ids.size());
}

int64_t BlockManager::num_computed_tokens(int64_t seq_id) const {
  return sequence(seq_id, "num_computed_tokens").num_computed;
}

bool BlockManager::can_allocate(int64_t num_tokens) const {
  TORCH_CHECK_VALUE(num_tokens >= 0, "BlockManager.can_allocate: num_tokens must be >= 0, got ",
                    num_tokens);
  return ceil_div(num_tokens, block_size_) <= num_free_blocks();
}

int64_t BlockManager::num_free_blocks() const {
  return int64_t(free_list_.size() + evictable_.size());
}

double BlockManager::usage() const {
  return double(num_blocks() - num_free_blocks()) / double(num_blocks());
}

BlockManagerStats BlockManager::stats() const {
  BlockManagerStats stats;
  stats.hits = hits_;
  stats.queries = queries_;
  stats.cached_blocks = int64_t(prefix_index_.size());
  stats.referenced_blocks = num_blocks() - num_free_blocks();
  stats.evictable_blocks = int64_t(evictable_.size());
  stats.free_blocks = int64_t(free_list_.size());
  return stats;
}

int64_t BlockManager::ref_count(int64_t block_id) const {
  TORCH_CHECK_VALUE(block_id >= 0 && block_id < num_blocks(), "BlockManager.ref_count: block ",
                    block_id, " is not in [0, ", num_blocks(), ")");
  return blocks_[block_id].ref_count;
}

}  // namespace fastllm

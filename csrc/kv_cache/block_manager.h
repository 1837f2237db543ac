// The block manager of a paged KV cache: it hands out the block ids of K/V pools
// [num_blocks, block_size, n_kv_heads, head_dim] (tensors owned elsewhere) to sequences, shares
// full blocks between sequences with the same token prefix (prefix caching, as in vLLM) and
// between forks (copy-on-write), and evicts the least recently used unreferenced cached block
// when the free list runs dry.
//
// A full block enters the prefix cache only once the caller says its KV is in the pools
// (mark_computed): a block allocated for a prompt chunk not yet run, or for a step that failed,
// must never be handed to another sequence as if it held that prefix's KV.
//
// Every block is in exactly one of three states: free (on the free list, no KV worth keeping),
// referenced (ref_count > 0), or evictable (a cached full block no sequence holds, kept for
// prefix reuse until its space is needed).
//
// Not thread-safe: one scheduler thread owns a manager.
#pragma once

#include <cstdint>
#include <limits>
#include <list>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fastllm {

// Too few free and evictable blocks for a request; the manager is left exactly as it was.
class KVCacheFullError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct BlockManagerStats {
  int64_t hits = 0;     // prompt blocks reused from the prefix cache
  int64_t queries = 0;  // prompt blocks looked up (those a prompt could reuse at most)
  int64_t cached_blocks = 0;  // full blocks in the prefix cache, referenced or evictable
  int64_t referenced_blocks = 0;
  int64_t evictable_blocks = 0;
  int64_t free_blocks = 0;  // on the free list only
};

class BlockManager {
 public:
  using BlockId = int32_t;
  using BlockCopy = std::pair<BlockId, BlockId>;  // (src, dst) block the caller must copy
  // A change of the prefix cache, for routers that mirror it (KV-cache events): a full block
  // cached under prefix_id (the prefix through it), chained onto parent_prefix_id with its
  // token_ids, or (stored false) the cached prefix prefix_id forgotten. A first block's parent
  // is kEmptyPrefix, or 2**63 | cache_salt for a salted chain.
  struct CacheEvent {
    bool stored;
    uint64_t prefix_id;
    uint64_t parent_prefix_id;
    std::vector<int64_t> token_ids;
  };

  BlockManager(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching);

  // Registers a sequence holding a prompt; returns how many of its tokens already have cached KV
  // (a multiple of block_size, at most len - 1 so that one token is left to compute).
  // Blocks are shared only between sequences of the same cache_salt (>= 0): KV computed under
  // one LoRA adapter, the engine's salt, never serves another.
  int64_t allocate(int64_t seq_id, const std::vector<int64_t>& token_ids,
                   bool reuse_cached = true, int64_t cache_salt = 0);
  // Extends a sequence; returns the copies copy-on-write needs before the new KV is written.
  // `cacheable` false: the new tokens' KV is not what a plain causal prefill of the sequence
  // computes (independent chunks), so neither their blocks nor any later ones of the sequence
  // enter the prefix cache.
  std::vector<BlockCopy> append_tokens(int64_t seq_id, const std::vector<int64_t>& token_ids,
                                       bool cacheable = true);
  // The sequence's first num_tokens tokens have their KV written: its full blocks among them
  // enter the prefix cache. Counts below the current one change nothing.
  void mark_computed(int64_t seq_id, int64_t num_tokens);
  // Drops the sequence's tokens from num_tokens on (rejected speculative drafts), with the
  // blocks that held only them. It may not cut into a block offered to the prefix cache.
  void truncate(int64_t seq_id, int64_t num_tokens);
  void fork(int64_t parent_seq_id, int64_t child_seq_id);
  void free(int64_t seq_id);

  const std::vector<BlockId>& block_table(int64_t seq_id) const;
  // int32 [seq_ids.size(), longest table], rows padded with block 0.
  at::Tensor block_tables(const std::vector<int64_t>& seq_ids) const;
  int64_t num_tokens(int64_t seq_id) const;
  int64_t num_computed_tokens(int64_t seq_id) const;

  // Drops every cached block no sequence holds (their KV is forgotten, the blocks free);
  // returns how many. Blocks sequences hold stay cached.
  int64_t reset_prefix_cache();
  // Recording of CacheEvents (off by default), and the events since the last take.
  void record_cache_events(bool on) { record_cache_events_ = on; }
  std::vector<CacheEvent> take_cache_events() { return std::exchange(cache_events_, {}); }
  bool can_allocate(int64_t num_tokens) const;  // without counting prefix-cache hits
  int64_t num_free_blocks() const;              // free list + evictable cached blocks
  double usage() const;                         // fraction of blocks referenced
  BlockManagerStats stats() const;
  int64_t ref_count(int64_t block_id) const;    // for tests and debugging

  int64_t num_blocks() const { return int64_t(blocks_.size()); }
  int64_t block_size() const { return block_size_; }
  bool enable_prefix_caching() const { return enable_prefix_caching_; }

 private:
  // A prefix id names one exact token prefix ending at a block boundary. Ids are never reused,
  // so a cached block matches a lookup only if its parent's prefix and its own tokens are equal:
  // a hash collision is a miss, never someone else's KV.
  static constexpr uint64_t kEmptyPrefix = 0;
  // Lost to a hash-slot collision, or past an uncacheable append.
  static constexpr uint64_t kUncachablePrefix = UINT64_MAX;

  struct Block {
    int64_t ref_count = 0;
    bool cached = false;  // in prefix_index_
    // While cached: its prefix_index_ key, its prefix, its parent's prefix and its tokens.
    uint64_t key = 0;
    uint64_t prefix_id = 0;
    uint64_t parent_prefix_id = 0;
    std::vector<int64_t> token_ids;
    std::list<BlockId>::iterator lru_position;  // while evictable
  };

  struct Sequence {
    std::vector<BlockId> blocks;
    std::vector<int64_t> token_ids;
    int64_t num_computed = 0;      // leading tokens whose KV is written (mark_computed)
    int64_t num_settled_blocks = 0;  // leading full computed blocks already offered to the cache
    int64_t uncacheable_from = std::numeric_limits<int64_t>::max();  // first uncacheable token
    uint64_t prefix_id = kEmptyPrefix;  // prefix through the last settled block
  };

  Sequence& sequence(int64_t seq_id, const char* op);
  const Sequence& sequence(int64_t seq_id, const char* op) const;
  void check_capacity(int64_t num_needed, int64_t num_available, const char* op,
                      int64_t seq_id) const;
  BlockId find_cached(uint64_t parent_prefix_id, const int64_t* token_ids) const;
  BlockId take_block();
  void uncache(BlockId block);  // out of the prefix index: its KV is no longer findable
  void acquire(BlockId block);
  void release(BlockId block);
  void cache_full_block(Sequence& seq, BlockId block, const int64_t* token_ids);

  const int64_t block_size_;
  const bool enable_prefix_caching_;
  std::vector<Block> blocks_;
  std::vector<BlockId> free_list_;  // a stack (take_block)
  std::list<BlockId> evictable_;  // least recently used first
  std::unordered_map<uint64_t, BlockId> prefix_index_;  // hash(parent prefix, tokens) -> block
  std::unordered_map<int64_t, Sequence> sequences_;
  uint64_t next_prefix_id_ = kEmptyPrefix + 1;
  int64_t hits_ = 0;
  int64_t queries_ = 0;
  bool record_cache_events_ = false;
  std::vector<CacheEvent> cache_events_;
};

}  // namespace fastllm

"""The KV side of the runtime that lives above the cache: blocks of a sequence's KV as objects of
their own (:mod:`.block`: format, artifact fingerprint, file round trip; :mod:`.transfer`: the
engine's export of a cache row's positions as a block and import of one), the prefix pool that
reuses them between requests (:mod:`.prefix_pool`: token-block index, byte budget, LRU eviction,
pinning), and the hand-off of disaggregated prefill/decode (:mod:`.handoff`: a request after its
first token as plain data plus one block; :mod:`.shm`: its block in POSIX shared memory between
processes; :mod:`.lend`: a cache in shared memory whose rows are lent to the taker, one copy).
None imports the engine nor ONNX Runtime; the batch loop calls them."""

from kvforge.runtime.kv.block import KVBlock, KVBlockError, fingerprint
from kvforge.runtime.kv.prefix_pool import PrefixHit, PrefixPool, PrefixPoolStats, parse_bytes

__all__ = ["KVBlock", "KVBlockError", "PrefixHit", "PrefixPool", "PrefixPoolStats", "fingerprint", "parse_bytes"]

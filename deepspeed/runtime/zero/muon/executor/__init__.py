"""How MuonWithAuxAdam's step runs: batching matrices, the lent workspace and its CUDA graphs, the host step of
ZeRO-Offload, updates prepared before the overflow verdict, and the Adam half's chunked and fused paths."""

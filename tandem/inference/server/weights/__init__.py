"""The server's weight updates (docs/weight-sync.md): `routes` (the HTTP routes), `requests` (their
bodies as typed requests), `receiver` (`WeightReceiver`: the state and the work), `staging` (a
staged set's buckets, a segment's byte window), `paths` (where disk updates may read). The engine's
side of a swap is `tandem.inference.weight_swap`.
"""

"""The worker side of a step: the model runner, the KV tensors (mirroring ``kv.store``)
and attention."""

"""The way bytes cross between host and devices.

Owns host copies for a save (`to_host`: a save's unsharded leaves, batched
from accelerators; an array held whole, gathered shard by shard; numpy
leaves' copies in host buffers reused from one async save to the next,
`pool`), the staging
window of a restore (`staging`) and the on-device buffers a large leaf is
streamed into (`streaming`). Nothing here knows a layout.
May import: `_format`, `_tree`, `_errors`.
"""

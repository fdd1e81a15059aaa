"""The safetensors format (an 8-byte header length, a JSON header, the tensors'
C-order bytes back to back): dtype codes (`dtypes`), checked headers
(`header`), index files (`index`), writing (`write`). Everything read is
attacker input: every rule an allow list, every read bounded.
May import: `_bytes`, `_errors`, `_tree`."""

"""Names vulture (80% confidence) reports in server/ that are used, each with the reason it cannot see the use.
Read by tests/unit/test_dead_code.py; never imported."""

q_idx  # flex_attention's mask_mod signature is (b, h, q_idx, kv_idx): decode masks need only kv_idx

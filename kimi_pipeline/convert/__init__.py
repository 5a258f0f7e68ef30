"""HF <-> Megatron conversion: the name/shape mapping (names.py) and the distributed torch_dist job."""

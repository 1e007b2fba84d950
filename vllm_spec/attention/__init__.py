from vllm_spec.attention.layer import Attention
from vllm_spec.attention.metadata import NULL_BLOCK, AttentionMetadata, compute_slot_mapping

__all__ = ["Attention", "AttentionMetadata", "NULL_BLOCK", "compute_slot_mapping"]

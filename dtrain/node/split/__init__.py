"""Split inference: the node side of the phone/browser split protocol (KV cache, DP noise, LoRA experts, HE-LoRA)."""

"""The LM head and its loss without the [tokens x vocabulary] logits.

loss = llmmem.linear_cross_entropy(hidden, lm_head.weight, labels, ignore_index=-100)
handle = llmmem.patch_lm_loss(hf_causal_lm)  # its loss from the hidden states; outputs.logits is None
"""

from llmmem.head.loss import linear_cross_entropy
from llmmem.head.patch import patch_lm_loss, unpatch_lm_loss

__all__ = ["linear_cross_entropy", "patch_lm_loss", "unpatch_lm_loss"]

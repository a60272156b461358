"""The LM head and its loss without the [tokens x vocabulary] logits.

loss = llmmem.linear_cross_entropy(hidden, lm_head.weight, labels, ignore_index=-100)
"""

from llmmem.head.loss import linear_cross_entropy

__all__ = ["linear_cross_entropy"]

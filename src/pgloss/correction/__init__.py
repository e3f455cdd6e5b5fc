"""What is applied beside a loss to the tokens it reads: the rollout correction (importance weights
and rejections against the inference engine), M2PO's second-moment mask and the token masks
(top-entropy, truncated completions, Clip_B and Clip_V's entropy-discriminator clipping)."""

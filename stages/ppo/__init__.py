"""PPO-max (Zheng et al., 2023, "Secrets of RLHF in LLMs Part I"): every trick a config switch.

Modules, in the order an iteration uses them: experience (rollouts and the four models'
forwards), rewards (score reparameterisation, token-level KL penalty), advantages (GAE),
losses (clipped policy and value losses, PPO-ptx, KL loss), trainer (the loop), checkpoint, and
stage (the pipeline stage: models, held-out evaluation, publishing the policy).
"""

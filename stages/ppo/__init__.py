"""PPO-max (Zheng et al., 2023, "Secrets of RLHF in LLMs Part I"): every trick a config switch.

Modules, in the order an iteration uses them: experience (rollouts and the four models'
forwards), rewards (score reparameterisation, token-level KL penalty), advantages (the registry
of advantage estimators: GAE, and grpo, rloo, reinforce++ without a critic), trainer (the loop),
collapse_guard (the live collapse guard), and stage (the pipeline stage on `stages.lifecycle`: models,
held-out evaluation, publishing the policy). Checkpoints are `stages.checkpoint`'s. The
losses (the registry of policy losses, the clipped value loss, PPO-ptx, the KL loss) are in
stages/losses.py, the forward passes and the decode step in stages/models/.
"""

"""PPO-max (Zheng et al., 2023, "Secrets of RLHF in LLMs Part I"): every trick a config switch.

Modules, in the order an iteration uses them: experience (rollouts and the four models'
forwards), reward_shaping (score reparameterisation, token-level KL penalty), advantages (the
registry of advantage estimators: GAE, and grpo, rloo, reinforce++ without a critic), trainer (the
loop); setup holds what the PPO, critic, eval and best-of-n stages share. The stage is
stages/pipeline/ppo.py, the collapse guard stages/runtime/collapse_guard.py. The losses are
stages/compute/losses.py's, the forward passes and the decode step stages/compute/models/'s.
"""

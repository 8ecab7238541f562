"""What the stages compute with: loading models and data, the training engine, losses, checkpoints,
the forward passes (models/), and by topic the PPO library (ppo/), the reward model and its server
(reward/) and the evaluations (evaluate/)."""

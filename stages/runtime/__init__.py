"""What a training stage runs inside: the lifecycle (checkpoints, resume, interrupts, non-finite
guards) and PPO's collapse guard, which runs the policy contract the stage hands it."""

"""Learning from the model's own samples (online RL with verifiable rewards): the generation
engine, the rollout phase, rewards, group advantages and the clipped policy-ratio loss. The
objective that trains on them is `trainer.objectives.grpo`; the prompts come from
`trainer.data.prompts`."""

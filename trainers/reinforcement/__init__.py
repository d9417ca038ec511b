"""The reinforcement stage (GRPO, ForesightKV §3.3): rollouts, branch groups, estimators, the
LightningModule and its data, and the run that refines a fitted scorer (`stage.refine_scorer`)."""

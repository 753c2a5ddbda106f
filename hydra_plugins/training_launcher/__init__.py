"""The training project's Hydra launcher; Hydra finds plugins under `hydra_plugins`."""

"""Hydra plugins of the training project (found by Hydra under the `hydra_plugins` namespace)."""

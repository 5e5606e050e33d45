"""Mixtral (and Mixtral-8x22B): softmax top-2, always renormalised; experts w1/w3/w2 on disk
under `block_sparse_moe` (transformers renames the block to `mlp` in memory)."""

from .base import FamilyAdapter


class MixtralAdapter(FamilyAdapter):
    family = "mixtral"
    model_types = ("mixtral",)
    disk_prefixes = ("model.layers.{l}.block_sparse_moe", "model.layers.{l}.mlp")
    per_expert = ("experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight")
    key_renames = ((".block_sparse_moe.", ".mlp."),)

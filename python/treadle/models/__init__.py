"""Embedded default models: tiny randomly initialised HF causal LMs of the architectures treadle
supports (:mod:`treadle.models.builders`), and the tiny trained Qwen3 used as default backbone,
policy and fixed solver (:mod:`treadle.models.tiny`). No downloads; any local HF checkpoint can be
used instead (:func:`load_default_model`).
"""
from treadle.models.builders import ARCHITECTURES, build_tiny_model, tiny_config
from treadle.models.tiny import (CheckpointError, CorruptCheckpointError, NotACausalLMError, TinyTrainConfig,
                                 TrainResult, build_tokenizer, cache_root, check_checkpoint, default_checkpoint_dir,
                                 load_default_model, train_tiny)

__all__ = ["ARCHITECTURES", "build_tiny_model", "tiny_config", "CheckpointError", "CorruptCheckpointError",
           "NotACausalLMError", "TinyTrainConfig", "TrainResult", "build_tokenizer", "cache_root", "check_checkpoint",
           "default_checkpoint_dir", "load_default_model", "train_tiny"]

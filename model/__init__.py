"""DeepSeek-V4: config, model, weight I/O."""
from .config import ConfigError, ModelConfig, load_hf_config
from .model import Transformer, build_model
from .weights import load_pretrained, save_pretrained

__all__ = ["ConfigError", "ModelConfig", "Transformer", "build_model", "load_hf_config", "load_pretrained",
           "save_pretrained"]

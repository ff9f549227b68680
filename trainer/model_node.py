"""The ``model`` node of a config: what its constructor takes, and the key plait reads itself.

``model.init_from`` (the weights a run starts from: a Hugging Face directory or a plait
checkpoint / run) is the user's key on the model node, but no model constructor reads it: it is
read where the model is configured (`trainer.build.build_task` hands it to `trainer.task.Task`,
which loads it after the strategy has parallelized the model, `trainer.init_from.load_init_from`).
A factory that reads the architecture from that directory takes it as its argument
(`trainer.models.hf.llama_from_hf`, ``model=hf``).
"""

from __future__ import annotations

import inspect
from typing import Any

from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, open_dict

# Keys of the model node plait reads itself, passed to the target only when its signature takes them.
NODE_KEYS = ("init_from",)


def takes(target: Any, key: str) -> bool:
    """Whether the callable ``target`` names the argument ``key`` (``**kwargs`` is not enough: a
    model passing them on to a base class, `trainer.models.moe_transformer.MoETransformer`, never
    takes plait's own keys)."""
    return key in inspect.signature(target).parameters


def constructor_node(node: DictConfig) -> DictConfig:
    """``node`` without the `NODE_KEYS` its ``_target_`` does not take (a copy; ``node`` itself when
    none is to drop). The target is imported: check an untrusted node first (`trainer.targets`)."""
    target = get_object(node._target_)
    drop = [k for k in NODE_KEYS if k in node and not takes(target, k)]
    if not drop:
        return node
    node = node.copy()
    with open_dict(node):
        for key in drop:
            del node[key]
    return node


def instantiate_model(node: DictConfig, **kwargs: Any) -> Any:
    """Hydra's ``instantiate`` of a model node (`constructor_node`); ``kwargs`` as there (``vocab_size``)."""
    return instantiate(constructor_node(node), **kwargs)


def init_from_of(node: Any) -> str | None:
    """The ``init_from`` of a model node as a string; None when unset (or no node)."""
    value = node.get("init_from") if isinstance(node, DictConfig) else None
    return str(value) if value else None

"""Errors every layer raises and catches by the same type."""

from __future__ import annotations


class RequestError(ValueError):
    """A request can never be served as given (too long, bad params, unknown id)."""


class FieldError(RequestError):
    """A request field is invalid; `field` names it (dotted for nested values, e.g. "logit_bias")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check(cond: bool, msg: str) -> None:
    """ValueError(msg) unless `cond`: the one-line validation of `__post_init__` checks (config
    sections, scenario and model shapes, KV spans); loaders re-raise it naming the file or key."""
    if not cond:
        raise ValueError(msg)

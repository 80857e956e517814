"""STAIR on Hugging Face causal LMs: attach a reflected bank read-out, run multi-turn sessions that
bank earlier responses' K/V, train the reflection normals, evaluate against native decoding
(STAIR sec. 3.4 / 4.4 / 5.4; DESIGN.md "STAIR").

    ctrl = treadle.stair.attach(model)          # layers="auto": (3, 11, 19), or spread on shallower models
    sess = treadle.stair.StairSession(model, tokenizer, ctrl)
    sess.generate("What is 3+4?"); sess.generate("What is 7*8?")   # turn 2 reads turn 1's bank
    ctrl.detach()                                                    # the model is exactly as before
"""
from treadle.stair.arch import SUPPORTED, UnsupportedModelError
from treadle.stair.bank import Bank, BankMismatchError, model_key
from treadle.stair.controller import (BANK_SPANS, KINDS, AlreadyAttachedError, NormalsFileError, StairController,
                                      attach, default_layers)
from treadle.stair.session import ContextOverflowError, StairSession, TurnResult

__all__ = ["attach", "default_layers", "StairController", "StairSession", "TurnResult", "Bank", "SUPPORTED",
           "BANK_SPANS", "KINDS",
           "UnsupportedModelError", "BankMismatchError", "NormalsFileError", "AlreadyAttachedError",
           "ContextOverflowError", "model_key"]

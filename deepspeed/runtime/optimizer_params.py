"""`optimizer.params`: one typed field per key of the optimizers DeepSpeed builds from the config.

The params are checked when the config is parsed, so a bad value fails `deepspeed.initialize` before any
model or optimizer state exists, with a message naming the key, the value and what is allowed. Muon's keys
are all listed here (an unknown one is refused); for Adam and every other torch optimizer the keys below are
checked and the others go on to the torch constructor, whose errors the engine reports as config errors.
Adding a key is one field line; a Muon field also says which param group it configures.
"""

import math
from typing import Any, ClassVar

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from deepspeed.runtime.config_utils import DeepSpeedConfigModel, validate_config
from deepspeed.runtime.constants import (
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    MUON_ADJUST_LR_FNS,
    MUON_NS_DTYPES,
    MUON_NS_COEFFICIENTS,
    MUON_MOMENTUM_DTYPES,
    MUON_NS_METHODS,
    MUON_OPTIMIZER,
    MUON_PARAM_SPLITS,
)

MUON_GROUP = "muon"
ADAM_GROUP = "adam"

# Newton-Schulz iterations: fewer than one is no orthogonalisation at all (plain momentum SGD, not Muon);
# the quintic iteration has converged long before 100 (5 is the reference), so more is a typo.
NS_STEPS_MIN, NS_STEPS_MAX = 1, 100


def _rule(groups: tuple[str, ...] = (), group_key: str | None = None, choices: tuple[str, ...] = ()) -> dict:
    """A field's extra metadata: the Muon param groups it configures (under `group_key`, default the key
    itself) and, for a string key, the values it may take."""
    return {"groups": groups, "group_key": group_key, "choices": choices}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class _ParamRules(DeepSpeedConfigModel):
    """Checks shared by the params models: JSON booleans, fixed string choices and Adam's betas.

    Numbers (no bools, strings, inf or nan; integers for int fields) are checked by the base model.
    """

    section: ClassVar[str] = "optimizer.params"

    @field_validator("*", mode="before")
    @classmethod
    def _check_flag_and_choice(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields[info.field_name]
        path = cls.key_path(info.field_name)
        # pydantic would turn "yes", "off", 1 or 0 into a bool; a config that says so is more likely a mistake.
        if field.annotation is bool and not isinstance(value, bool):
            raise ValueError(f"{path} must be true or false, got {value!r}")
        choices = (field.json_schema_extra or {}).get("choices")
        if choices and not (value is None and _allows_none(field.annotation)):
            if not (isinstance(value, str) and value in choices):
                nullable = " or null" if _allows_none(field.annotation) else ""
                raise ValueError(f"{path} must be one of {sorted(choices)}{nullable}, got {value!r}")
        return value

    @field_validator("betas", mode="before", check_fields=False)
    @classmethod
    def _betas_pair(cls, value: Any) -> tuple[float, float]:
        if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_number(b) and 0 <= b < 1
                                                                            for b in value)):
            raise ValueError(f"{cls.key_path('betas')} must be a list of two numbers in [0, 1), got {value!r}")
        return (float(value[0]), float(value[1]))


def _allows_none(annotation: Any) -> bool:
    return type(None) in getattr(annotation, "__args__", ())


class OptimizerParams(_ParamRules):
    """Keys that mean the same for every torch optimizer; any other key goes to the optimizer's constructor."""

    model_config = ConfigDict(title="optimizer.params", extra="allow")

    # Defaults are None and never used: only the keys given are passed on, so the constructor's defaults apply.
    lr: float = Field(None, ge=0, description="Learning rate.")
    weight_decay: float = Field(None, ge=0, description="Weight decay.")
    eps: float = Field(None, gt=0, description="Added to the denominator; > 0, since 0 divides a zero gradient "
                       "by zero.")
    betas: tuple[float, float] = Field(None, description="Adam's two moment decay rates, each in [0, 1).")

    @classmethod
    def _check_keys(cls, data: dict[str, Any]) -> None:
        """Keys not listed here are the constructor's to accept or refuse."""


class AdamParams(OptimizerParams):
    """`adam` and `adamw` (torch.optim.Adam / AdamW); the flags below are DeepSpeed's or torch's."""

    model_config = ConfigDict(title="optimizer.params (adam, adamw)", extra="allow")

    adam_w_mode: bool = Field(None, description="Decoupled weight decay (AdamW) for type adam; default true.")
    torch_adam: bool = Field(None, description="Upstream's choice of torch's Adam over its fused op; here the "
                             "implementation is chosen for you: torch's Adam/AdamW, or DeepSpeedCPUAdam with "
                             "optimizer offload.")
    amsgrad: bool = Field(None, description="torch's AMSGrad variant.")


class MuonParams(_ParamRules):
    """`muon` (MuonWithAuxAdam): Muon for hidden matrices, Adam for the other parameters. Every key is listed."""

    model_config = ConfigDict(title="optimizer.params (muon)")

    lr: float = Field(None, ge=0, json_schema_extra=_rule((MUON_GROUP, ADAM_GROUP)),
                      description="Learning rate of both groups (Muon 0.02, Adam 3e-4 when absent).")
    muon_lr: float = Field(None, ge=0, json_schema_extra=_rule((MUON_GROUP, ), "lr"),
                           description="Learning rate of the Muon group; overrides lr.")
    adam_lr: float = Field(None, ge=0, json_schema_extra=_rule((ADAM_GROUP, ), "lr"),
                           description="Learning rate of the Adam group; overrides lr.")
    weight_decay: float = Field(None, ge=0, json_schema_extra=_rule((MUON_GROUP, ADAM_GROUP)),
                                description="Decoupled weight decay of both groups (0).")
    momentum: float = Field(None, ge=0, lt=1, json_schema_extra=_rule((MUON_GROUP, )),
                            description="Muon momentum, in [0, 1) (0.95).")
    nesterov: bool = Field(None, json_schema_extra=_rule((MUON_GROUP, )),
                           description="Nesterov momentum (true).")
    ns_method: str = Field(None, json_schema_extra=_rule((MUON_GROUP, ), choices=MUON_NS_METHODS),
                           description="Newton-Schulz variant: standard, gram, gram_sym or auto (auto, by shape).")
    ns_coefficients: str = Field(None, json_schema_extra=_rule((MUON_GROUP, ), choices=MUON_NS_COEFFICIENTS),
                                 description="Newton-Schulz coefficient schedule: jordan (Keller Jordan's quintic at "
                                 "every step) or polar_express (per-step optimal quintics) (jordan).")
    ns_steps: int = Field(None, ge=NS_STEPS_MIN, le=NS_STEPS_MAX, json_schema_extra=_rule((MUON_GROUP, )),
                          description="Newton-Schulz iterations, an integer in [1, 100] (5).")
    ns_dtype: str | None = Field(None, json_schema_extra=_rule((MUON_GROUP, ), choices=MUON_NS_DTYPES),
                                 description="Newton-Schulz compute dtype: fp32, bf16, fp16, or null to choose "
                                 "by device (null).")
    ns_cuda_graph: bool = Field(None, json_schema_extra=_rule((MUON_GROUP, )),
                                description="Replay Newton-Schulz from a CUDA graph on a GPU (false).")
    momentum_dtype: str = Field(None, json_schema_extra=_rule((MUON_GROUP, ), choices=MUON_MOMENTUM_DTYPES),
                                description="The dtype Muon's momentum is kept in: fp32, or bf16 to halve its memory "
                                "(every fold computed in fp32, stored rounded) (fp32).")
    normuon: bool = Field(None, json_schema_extra=_rule((MUON_GROUP, )),
                          description="NorMuon: normalise each row of the orthogonalised update by its running "
                          "second moment, then rescale to Muon's norm (false).")
    normuon_beta2: float = Field(None, ge=0, lt=1, json_schema_extra=_rule((MUON_GROUP, )),
                                 description="NorMuon's second-moment decay, in [0, 1) (0.95).")
    normuon_eps: float = Field(None, gt=0, json_schema_extra=_rule((MUON_GROUP, )),
                               description="NorMuon's epsilon, added to the root of the second moment, > 0 (1e-8).")
    betas: tuple[float, float] = Field(None, json_schema_extra=_rule((ADAM_GROUP, )),
                                       description="Adam group's moment decay rates, each in [0, 1) ([0.9, 0.95]).")
    eps: float = Field(None, gt=0, json_schema_extra=_rule((ADAM_GROUP, )),
                       description="Adam group's epsilon, > 0 (1e-10).")
    adjust_lr_fn: str | None = Field(None, json_schema_extra=_rule((MUON_GROUP, ), choices=MUON_ADJUST_LR_FNS),
                                     description="How the orthogonalised update is scaled by the matrix shape: "
                                     "original (sqrt(max(1, rows/cols))) or match_rms_adamw (0.2 * sqrt(max(rows, "
                                     "cols)), so an AdamW learning rate carries over); null is original.")
    param_split: str = Field(None, json_schema_extra=_rule(choices=MUON_PARAM_SPLITS),
                             description="Which parameters Muon takes: hidden (the hidden matrices; embeddings, the "
                             "output head, norms and biases go to Adam) or upstream (every matrix whose name "
                             "contains neither embed nor lm_head) (hidden); a parameter's own use_muon wins.")
    per_head_muon: bool = Field(None, json_schema_extra=_rule(),
                                description="Orthogonalise each head's rows of the attention q/k/v projections on "
                                "their own (false); the engine tags the model with it (docs/muon.md).")

    @model_validator(mode="after")
    def _normuon_options_need_normuon(self) -> "MuonParams":
        # Without NorMuon these keys would change nothing: a config that sets them meant to turn it on.
        for key in ("normuon_beta2", "normuon_eps"):
            if getattr(self, key) is not None and self.normuon is not True:
                raise ValueError(f"{self.key_path(key)} is set but {self.key_path('normuon')} is {self.normuon!r} "
                                 "(NorMuon off), so it would be ignored; set normuon to true or remove the key")
        return self

    @classmethod
    def _check_keys(cls, data: dict[str, Any]) -> None:
        unknown = [key for key in data if key not in cls.model_fields]
        if unknown:
            raise ValueError(f"optimizer.params key '{unknown[0]}' is not supported by the Muon optimizer; "
                             f"allowed keys: {sorted(cls.model_fields)}")

    @classmethod
    def group_options(cls, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Validated params split into the Muon group's and the Adam group's options.

        A key with a `group_key` (muon_lr, adam_lr) is applied after the shared key (lr), so it wins.
        """
        options: dict[str, dict[str, Any]] = {MUON_GROUP: {}, ADAM_GROUP: {}}
        for key in sorted(params, key=lambda k: cls.model_fields[k].json_schema_extra["group_key"] is not None):
            rule = cls.model_fields[key].json_schema_extra
            for group in rule["groups"]:
                options[group][rule["group_key"] or key] = params[key]
        return options[MUON_GROUP], options[ADAM_GROUP]


PARAMS_MODELS: dict[str, type[_ParamRules]] = {
    MUON_OPTIMIZER: MuonParams,
    ADAM_OPTIMIZER: AdamParams,
    ADAMW_OPTIMIZER: AdamParams,
}


def validate_optimizer_params(optimizer_name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The given keys of `optimizer.params`, checked and normalised (betas as a tuple, integral ns_steps an int).

    Args:
        optimizer_name: the resolved `optimizer.type` (lower-case DeepSpeed name or torch.optim class name).
        params: `optimizer.params` without "auto" values.

    Raises:
        DeepSpeedConfigError: a value of the wrong type or out of range, or an unknown Muon key; the message
            names the key, the value and what is allowed.
    """
    model = validate_config(PARAMS_MODELS.get(optimizer_name, OptimizerParams), params)
    return model.model_dump(exclude_unset=True)

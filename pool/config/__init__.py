"""Settings: models, file loading and merging, the check of one load-override value.

Each backend's model class, override fields and tables live in its module under
pool/backends, which imports this package (never the other way round): the backend
registry hands this package its lookup of model classes when it is imported
(:func:`use_definition_classes`), and the load body is validated beside the registry
(``pool.backends.LoadRequest``).
"""

from pool.config._cluster import ClusterSettings
from pool.config._files import (
    ENV_OP_TOKEN_KEY_PATH,
    LOCAL_SETTINGS_ENV,
    SETTINGS_ENV,
    build_settings,
    cache_dir,
    default_local_path,
    default_settings_path,
    environment_settings,
    load_settings,
    merge,
    read_json,
    resolve_model_path,
    state_dir,
)
from pool.config._load_request import check_override_value, invalid_load_request
from pool.config._models import (
    SHA256_HEX_PATTERN,
    AuthSettings,
    BudgetRule,
    CommonModelFields,
    DecodingDefaults,
    EngineSettings,
    KeyFields,
    KeyRole,
    KeySettings,
    ModelDefinition,
    PriorityName,
    PromptFormatName,
    ServiceSettings,
    Settings,
    TenancySettings,
    TenantLimits,
    TracingSettings,
    UnknownBackendError,
    UsageSettings,
    definition_class,
    model_definition,
    use_definition_classes,
)

__all__ = [
    "ENV_OP_TOKEN_KEY_PATH",
    "LOCAL_SETTINGS_ENV",
    "SETTINGS_ENV",
    "SHA256_HEX_PATTERN",
    "AuthSettings",
    "BudgetRule",
    "ClusterSettings",
    "CommonModelFields",
    "DecodingDefaults",
    "EngineSettings",
    "KeyFields",
    "KeyRole",
    "KeySettings",
    "ModelDefinition",
    "PriorityName",
    "PromptFormatName",
    "ServiceSettings",
    "Settings",
    "TenancySettings",
    "TenantLimits",
    "TracingSettings",
    "UnknownBackendError",
    "UsageSettings",
    "build_settings",
    "cache_dir",
    "check_override_value",
    "default_local_path",
    "default_settings_path",
    "definition_class",
    "environment_settings",
    "invalid_load_request",
    "load_settings",
    "merge",
    "model_definition",
    "read_json",
    "resolve_model_path",
    "state_dir",
    "use_definition_classes",
]

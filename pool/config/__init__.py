"""Settings: models, file loading and merging, load-override validation.

Each backend's model class, override fields and tables live in its module under
pool/backends; what this package needs of them it looks up in the backend registry.
"""

from pool.config._cluster import ClusterSettings
from pool.config._files import (
    ENV_OP_TOKEN_KEY_PATH,
    LOCAL_SETTINGS_ENV,
    SETTINGS_ENV,
    build_settings,
    cache_dir,
    environment_settings,
    load_settings,
    merge,
    resolve_model_path,
    state_dir,
)
from pool.config._load_request import (
    LoadRequest,
    apply_override,
    check_override_value,
    invalid_load_request,
    load_constraints,
    load_recommendations,
    load_request_schema,
    validate_load_request,
)
from pool.config._models import (
    AuthSettings,
    CommonModelFields,
    DecodingDefaults,
    EngineSettings,
    ModelDefinition,
    PromptFormatName,
    ServiceSettings,
    Settings,
    TenancySettings,
    TenantLimits,
    UnknownBackendError,
    definition_class,
    model_definition,
)

__all__ = [
    "ENV_OP_TOKEN_KEY_PATH",
    "LOCAL_SETTINGS_ENV",
    "SETTINGS_ENV",
    "AuthSettings",
    "ClusterSettings",
    "CommonModelFields",
    "DecodingDefaults",
    "EngineSettings",
    "LoadRequest",
    "ModelDefinition",
    "PromptFormatName",
    "ServiceSettings",
    "Settings",
    "TenancySettings",
    "TenantLimits",
    "UnknownBackendError",
    "apply_override",
    "build_settings",
    "cache_dir",
    "check_override_value",
    "definition_class",
    "environment_settings",
    "invalid_load_request",
    "load_constraints",
    "load_recommendations",
    "load_request_schema",
    "load_settings",
    "merge",
    "model_definition",
    "resolve_model_path",
    "state_dir",
    "validate_load_request",
]

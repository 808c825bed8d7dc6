#!/usr/bin/env bash
# Remove the llm-pool user service: install.sh --uninstall (add --purge for settings).
exec "$(dirname "$0")/install.sh" --uninstall "$@"

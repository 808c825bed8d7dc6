#!/usr/bin/env bash
# Install (or upgrade) llm-pool as a systemd user service, or remove it.
#
#   deploy/systemd/install.sh [--prefix DIR] [--extras LIST] [--no-pip] [--no-start]
#   deploy/systemd/install.sh --uninstall [--prefix DIR] [--purge]
#
# What goes where ($HOME and the XDG variables are respected):
#   $PREFIX (default ${XDG_DATA_HOME:-~/.local/share}/llm-pool)
#       venv/                      the virtual environment the service runs from
#       bin/llm-pool-healthcheck   GET /v1/models, used by the unit's ExecStartPost
#   ${XDG_CONFIG_HOME:-~/.config}/llm-pool/
#       settings.json              copied from config/ once; yours from then on
#       llm-pool.env               the service's environment (tokens, LOG_FORMAT), mode 600
#   ${XDG_CONFIG_HOME:-~/.config}/systemd/user/llm-pool.service
#
# Running it again upgrades: the package is reinstalled from this checkout, the unit is
# rewritten, your settings and environment file are kept, the service is restarted.
# --no-pip skips installing into the venv (a venv you manage yourself); --no-start
# writes the files without calling systemctl. --uninstall stops and removes the unit,
# the venv and the health check; --purge removes the settings and environment too.
set -euo pipefail

SOURCE="$(cd "$(dirname "$0")/../.." && pwd)"
PREFIX="${XDG_DATA_HOME:-$HOME/.local/share}/llm-pool"
CONFIG_DIR="${XDG_CONFIG_HOME:-$HOME/.config}/llm-pool"
UNIT_DIR="${XDG_CONFIG_HOME:-$HOME/.config}/systemd/user"
EXTRAS="llama-cpp"
PYTHON="${PYTHON:-python3}"
PIP=1 START=1 UNINSTALL=0 PURGE=0

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX="$(realpath -m "$2")"; shift 2 ;;
    --extras) EXTRAS="$2"; shift 2 ;;
    --no-pip) PIP=0; shift ;;
    --no-start) START=0; shift ;;
    --uninstall) UNINSTALL=1; shift ;;
    --purge) PURGE=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
VENV="$PREFIX/venv"
UNIT="$UNIT_DIR/llm-pool.service"
ENV_FILE="$CONFIG_DIR/llm-pool.env"

have_systemctl() { [ "$START" = 1 ] && command -v systemctl >/dev/null 2>&1; }

if [ "$UNINSTALL" = 1 ]; then
  if have_systemctl; then
    systemctl --user disable --now llm-pool.service 2>/dev/null || true
  fi
  rm -f "$UNIT"
  rm -rf "$VENV" "$PREFIX/bin/llm-pool-healthcheck"
  rmdir "$PREFIX/bin" "$PREFIX" 2>/dev/null || true
  if [ "$PURGE" = 1 ]; then
    rm -f "$CONFIG_DIR/settings.json" "$CONFIG_DIR/local.json" "$ENV_FILE"
    rmdir "$CONFIG_DIR" 2>/dev/null || true
  fi
  if have_systemctl; then systemctl --user daemon-reload || true; fi
  echo "llm-pool service removed$([ "$PURGE" = 1 ] && echo ", settings purged" || echo "; settings kept in $CONFIG_DIR")"
  exit 0
fi

mkdir -p "$PREFIX/bin" "$CONFIG_DIR" "$UNIT_DIR"
if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  if [ "$PIP" = 1 ]; then "$PYTHON" -m venv "$VENV"; else "$PYTHON" -m venv --without-pip "$VENV"; fi
fi
if [ "$PIP" = 1 ]; then
  echo "== installing llm-pool[$EXTRAS] from $SOURCE"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet --upgrade "$SOURCE${EXTRAS:+[$EXTRAS]}"
fi

install -m 755 "$SOURCE/deploy/systemd/healthcheck.py" "$PREFIX/bin/llm-pool-healthcheck"
[ -e "$CONFIG_DIR/settings.json" ] || install -m 644 "$SOURCE/config/settings.json" "$CONFIG_DIR/settings.json"
[ -e "$ENV_FILE" ] || install -m 600 "$SOURCE/deploy/systemd/llm-pool.env" "$ENV_FILE"

sed -e "s|@PREFIX@|$PREFIX|g" -e "s|@VENV@|$VENV|g" -e "s|@CONFIG_DIR@|$CONFIG_DIR|g" \
    -e "s|@ENV_FILE@|$ENV_FILE|g" -e "s|@SOURCE@|$SOURCE|g" \
    "$SOURCE/deploy/systemd/llm-pool.service.in" > "$UNIT.tmp"
mv "$UNIT.tmp" "$UNIT"
echo "== wrote $UNIT"

if have_systemctl; then
  systemctl --user daemon-reload
  systemctl --user enable llm-pool.service
  systemctl --user restart llm-pool.service
  echo "== started: systemctl --user status llm-pool; logs: journalctl --user -u llm-pool -f"
  echo "   (to keep it running after you log out: loginctl enable-linger $USER)"
else
  echo "== not started: systemctl --user daemon-reload && systemctl --user enable --now llm-pool"
fi

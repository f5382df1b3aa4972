# Shared by the hack/e2e scripts (sourced, never run): logging, the cache directory, Debian packages.
#
# Everything slow is cached OUTSIDE the repository under ${STOWAWAY_CACHE:-$HOME/.cache/stowaway}/e2e,
# keyed by the versions that produced it, so a fresh clone on the same machine reuses it.
# shellcheck shell=bash

E2E_HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
E2E_ROOT="$(cd "$E2E_HERE/../.." && pwd)"
E2E_CACHE="${STOWAWAY_CACHE:-$HOME/.cache/stowaway}/e2e"

log() { printf '[e2e %s %s] %s\n' "${E2E_STEP:-${0##*/}}" "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Installs the Debian packages that are missing (apt-get update first, once), as root.
ensure_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  [[ $(id -u) -eq 0 ]] || die "missing Debian packages ${missing[*]}: install them (apt-get install ${missing[*]}) or run as root"
  log "installing Debian packages: ${missing[*]}"
  apt-get update -qq >&2 || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
    || die "apt-get install ${missing[*]} failed"
}

# The first Debian mirror apt is configured with (deb822 .sources or one-line .list), read at run time
# so no mirror host is ever written into the repository.
debian_mirror() {
  local f uri
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    uri=$(awk '/^URIs:/ {print $2; exit}' "$f")
    if [[ -n $uri && $uri != *security* ]]; then echo "$uri"; return; fi
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -f $f ]] || continue
    uri=$(awk '$1 == "deb" && $0 ~ / bookworm / { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' "$f")
    if [[ -n $uri && $uri != *security* ]]; then echo "$uri"; return; fi
  done
  die "no Debian mirror found in /etc/apt/sources.list*"
}

# Serialises one step across processes (a test fixture and a user's shell), by a lock file in the cache.
take_lock() {
  mkdir -p "$E2E_CACHE"
  exec 8>"$E2E_CACHE/.$1.lock"
  if ! flock -n 8; then
    log "another process holds $E2E_CACHE/.$1.lock; waiting"
    flock 8
  fi
}

# The Go toolchain with hack/control-plane/build's module and build caches (Kubernetes' packages compile once).
use_go_caches() {
  local caches="${STOWAWAY_TOOLS_CACHE:-${HOME}/.cache/stowaway/tools}/go"
  command -v go >/dev/null 2>&1 || PATH="/usr/local/go/bin:$PATH"
  command -v go >/dev/null 2>&1 || die "no Go toolchain found; Go >= 1.26 is required"
  export GOPATH="$caches" GOMODCACHE="$caches/mod" GOCACHE="$caches/build-cache"
  export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -modcacherw -buildvcs=false"
}

#!/usr/bin/env bash
# Makes CubeCL's LLVM build dependency work offline (idempotent).
#
# cubecl-llvm's build script (through `tracel-llvm-bundler` 23.1.0-4) downloads a prebuilt LLVM
# unless its install directory already holds one; only package registries are reachable here, so
# this script fills that directory from Debian's LLVM 22 instead (bookworm-security has it):
# links to `/usr/lib/llvm-22`, an `llvm-config` wrapper whose `--system-libs` names libraries as
# `-lNAME` (the bundler turns an absolute `.so` path into a broken `-l /path`), and the marker
# file the bundler looks for. See shared/research/stack.md.
set -euo pipefail

dir="${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-23.1.0-4"
llvm=/usr/lib/llvm-22
if [[ -f "$dir/.tracel-llvm-installed" && -x "$llvm/bin/llvm-config" ]]; then
    exit 0
fi

if [[ ! -x "$llvm/bin/llvm-config" ]]; then
    echo "install-llvm: installing llvm-22-dev from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        llvm-22-dev libpolly-22-dev libzstd-dev zlib1g-dev libxml2-dev >/dev/null
fi

rm -rf "$dir"
mkdir -p "$dir/bin"
for d in lib include share; do
    ln -s "$llvm/$d" "$dir/$d"
done
for b in "$llvm"/bin/*; do
    [[ "$(basename "$b")" == llvm-config ]] || ln -s "$b" "$dir/bin/"
done
cat > "$dir/bin/llvm-config" <<WRAP
#!/usr/bin/env bash
# Debian's llvm-config, with absolute library paths in its output turned into -lNAME.
"$llvm/bin/llvm-config" "\$@" | sed -E 's#/[^ ]*/lib([A-Za-z0-9_+-]+)\.so(\.[0-9.]+)?#-l\1#g'
WRAP
chmod +x "$dir/bin/llvm-config"
touch "$dir/.tracel-llvm-installed"
echo "install-llvm: $dir -> $llvm ($("$dir/bin/llvm-config" --version))"

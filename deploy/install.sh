#!/bin/sh
# Installs gpufrac from the directory this script is in: an unpacked release
# tarball, or the tree `cargo xtask install` stages. POSIX sh, so that it
# runs on any node the release runs on.
set -eu

usage() {
    cat <<'EOF'
Usage: install.sh [--prefix PREFIX] [--destdir DIR] [--unitdir DIR] [--uninstall]

Installs under PREFIX (default /usr/local):
  PREFIX/bin/gpufrac
  PREFIX/lib/libgpufrac.so
  PREFIX/include/gpufrac.h
  PREFIX/libexec/gpufrac-task-prolog  (Slurm's TaskProlog, its path rewritten)
  PREFIX/share/gpufrac/          k8s/ (DaemonSet, example Pod), slurm/ (conf lines)
  PREFIX/share/doc/gpufrac/     README.md, install.md, SECURITY.md, LICENSE
  UNITDIR/gpufrac-broker.service (its paths rewritten to PREFIX)
  UNITDIR/gpufrac-cdi.service   (writes the CDI spec at boot; not enabled)

  --prefix PREFIX  where gpufrac lives (absolute)
  --destdir DIR    write under DIR instead of /, for building a package;
                   the files still name PREFIX
  --unitdir DIR    where the systemd unit goes (default PREFIX/lib/systemd/system;
                   use /etc/systemd/system for a prefix systemd does not search)
  --uninstall      remove what an install with the same options put there
EOF
}

prefix=/usr/local
destdir=
unitdir=
uninstall=no
while [ $# -gt 0 ]; do
    case $1 in
    --prefix | --destdir | --unitdir)
        if [ $# -lt 2 ]; then
            echo "install.sh: $1 needs a value" >&2
            exit 2
        fi
        opt=$1
        val=$2
        shift 2
        ;;
    --prefix=* | --destdir=* | --unitdir=*)
        opt=${1%%=*}
        val=${1#*=}
        shift
        ;;
    --uninstall)
        uninstall=yes
        shift
        continue
        ;;
    -h | --help)
        usage
        exit 0
        ;;
    *)
        echo "install.sh: unknown argument: $1" >&2
        usage >&2
        exit 2
        ;;
    esac
    case $opt in
    --prefix) prefix=$val ;;
    --destdir) destdir=$val ;;
    --unitdir) unitdir=$val ;;
    esac
done

# The unit's paths are rewritten with sed; a prefix is a plain absolute path.
for p in "$prefix" ${unitdir:+"$unitdir"}; do
    case $p in
    /*) ;;
    *)
        echo "install.sh: $p: must be an absolute path" >&2
        exit 2
        ;;
    esac
    case $p in
    *[!A-Za-z0-9/._+@-]*)
        echo "install.sh: $p: only letters, digits and / . _ + @ - are supported in paths" >&2
        exit 2
        ;;
    esac
done
prefix=${prefix%/}
unitdir=${unitdir:-$prefix/lib/systemd/system}
unitdir=${unitdir%/}
here=$(cd "$(dirname "$0")" && pwd)
root=$destdir$prefix
docs="README.md install.md SECURITY.md LICENSE"
shared="k8s/daemonset.yaml k8s/pod-example.yaml slurm/slurm.conf.example slurm/gres.conf.example"

if [ $uninstall = yes ]; then
    rm -f "$root/bin/gpufrac" "$root/lib/libgpufrac.so" "$root/include/gpufrac.h" \
        "$root/libexec/gpufrac-task-prolog" "$destdir$unitdir/gpufrac-broker.service" \
        "$destdir$unitdir/gpufrac-cdi.service"
    for f in $shared; do
        rm -f "$root/share/gpufrac/$f"
    done
    rmdir "$root/share/gpufrac/k8s" "$root/share/gpufrac/slurm" "$root/share/gpufrac" 2>/dev/null || true
    for f in $docs; do
        rm -f "$root/share/doc/gpufrac/$f"
    done
    rmdir "$root/share/doc/gpufrac" 2>/dev/null || true
    echo "gpufrac removed from $prefix"
    exit 0
fi

for f in bin/gpufrac lib/libgpufrac.so include/gpufrac.h libexec/gpufrac-task-prolog lib/systemd/system/gpufrac-broker.service lib/systemd/system/gpufrac-cdi.service $docs \
    $(for f in $shared; do echo "share/gpufrac/$f"; done); do
    if [ ! -f "$here/$f" ]; then
        echo "install.sh: $here/$f is missing; run this script from an unpacked gpufrac release" >&2
        exit 1
    fi
done

install -d -m 0755 "$root/bin" "$root/lib" "$root/include" "$root/libexec" "$root/share/doc/gpufrac" \
    "$root/share/gpufrac/k8s" "$root/share/gpufrac/slurm" "$destdir$unitdir"
# install(1) replaces a file by a new one rather than writing into it, so
# running processes keep the library and binary they mapped: copying over
# a library in use would crash them.
install -m 0755 "$here/bin/gpufrac" "$root/bin/gpufrac"
install -m 0755 "$here/lib/libgpufrac.so" "$root/lib/libgpufrac.so"
install -m 0644 "$here/include/gpufrac.h" "$root/include/gpufrac.h"
for f in $docs; do
    install -m 0644 "$here/$f" "$root/share/doc/gpufrac/$f"
done
# Files that name where gpufrac lives get the prefix in place of /usr/local.
rewrite() { # FROM TO MODE
    sed "s|/usr/local/|$prefix/|g" "$1" >"$2.tmp"
    chmod "$3" "$2.tmp"
    mv -f "$2.tmp" "$2"
}
rewrite "$here/libexec/gpufrac-task-prolog" "$root/libexec/gpufrac-task-prolog" 0755
for f in $shared; do
    rewrite "$here/share/gpufrac/$f" "$root/share/gpufrac/$f" 0644
done
rewrite "$here/lib/systemd/system/gpufrac-cdi.service" "$destdir$unitdir/gpufrac-cdi.service" 0644
unit=$destdir$unitdir/gpufrac-broker.service
rewrite "$here/lib/systemd/system/gpufrac-broker.service" "$unit" 0644

echo "gpufrac installed under $destdir$prefix (unit: $unit)"
if [ -n "$destdir" ]; then
    exit 0
fi
echo
echo "To run the broker (as root):"
if ! getent group gpufrac >/dev/null 2>&1; then
    echo "  groupadd --system gpufrac"
fi
case $unitdir in
/etc/systemd/system | /usr/local/lib/systemd/system | /usr/lib/systemd/system | /lib/systemd/system)
    echo "  systemctl daemon-reload"
    echo "  systemctl enable --now gpufrac-broker"
    ;;
*)
    echo "  systemctl enable --now $unit    # systemd does not search $unitdir"
    ;;
esac
echo "  usermod -aG gpufrac USER    # for each user of the GPUs (takes effect at their next login)"

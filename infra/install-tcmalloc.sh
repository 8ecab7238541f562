#!/usr/bin/env bash
# TCMalloc for the processes that train (stages/leaves/allocator.py): Debian/Ubuntu's libtcmalloc-minimal4,
# where this user may install packages. Without it, training runs on the system's malloc (slower on a CPU).
if ls /usr/lib/*/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; } && exit 0
fi
echo "note: TCMalloc is not installed (Debian/Ubuntu: apt-get install libtcmalloc-minimal4);" \
     "training runs on the system's malloc, slower on a CPU (stages/leaves/allocator.py)" >&2

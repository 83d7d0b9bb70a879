# SPDX-License-Identifier: MIT
# Cross-compiling mha for aarch64 Linux with Debian's gcc-aarch64-linux-gnu; the tests run under
# qemu-user (qemu-aarch64). cJSON comes from Debian's multiarch libcjson-dev:arm64, which brings
# the arm64 C library (libc6:arm64) into / as well. The emulator must then load that library's own
# dynamic loader (-L /): with -L /usr/aarch64-linux-gnu, the cross toolchain's ld.so (a different
# Debian revision of glibc 2.36) meets the multiarch libc.so.6 and pthread_create spins forever
# in the stack-cache list. tools/test_aarch64.sh builds and runs it.
#   cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# Only target libraries, headers and packages: the cross toolchain's own tree and Debian's
# multiarch arm64 directories (/usr/lib/aarch64-linux-gnu, reached through "/" and
# CMAKE_LIBRARY_ARCHITECTURE). The root "/" also holds the host's libraries, which find_library
# never looks at here (it searches <root>/usr/lib/aarch64-linux-gnu, not .../x86_64-linux-gnu);
# pkg-config would report them, so it reads only the arm64 .pc files (below).
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
# pkg-config (cairo for the CLI's plots, MHA_CAIRO=AUTO): the arm64 modules only, so that
# cairo is used when libcairo2-dev:arm64 is installed and not found (not the host's x86-64
# libcairo.so, "file in wrong format" at link) when it is not.
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/aarch64-linux-gnu/lib/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")
# MPI (MHA_MPI=AUTO): FindMPI would ask the host's mpicc; the target's MPI is not looked for.
set(MPI_C_COMPILER MPI_C_COMPILER-NOTFOUND CACHE FILEPATH "")
if(EXISTS /lib/ld-linux-aarch64.so.1)
  set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /)
else()
  set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu)
endif()

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
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
if(EXISTS /lib/ld-linux-aarch64.so.1)
  set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /)
else()
  set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu)
endif()

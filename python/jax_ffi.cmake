# SPDX-License-Identifier: MIT
# The XLA FFI handler of mha.jax (python/mha/_jax_ffi.cc), a plain shared library `_jax_ffi.so`
# that mha/jax.py loads with ctypes and registers with jax.ffi.register_ffi_target. Included (at
# file scope: it may enable C++) by python/CMakeLists.txt (the package) and tests/CMakeLists.txt
# (the tests' copy, found through MHA_JAX_FFI).
#   In:  MHA_JAX_PYTHON    an interpreter that imports jax (to find jaxlib's FFI headers)
#        MHA_JAX_INCLUDE_DIR (cache) the headers' directory, overriding the interpreter's answer
#                            (`pip install` builds in an isolated environment without jax)
#   Out: MHA_JAX_FFI_TARGET  the target name, empty when it is not built (no jaxlib headers or no
#                            C++ compiler: the package then works without mha.jax)
# The handler links libmha (mha_shared): loaded after mha/_lib.py has loaded libmha, its
# dependency on the SONAME resolves to that same copy.
set(MHA_JAX_FFI_TARGET "")
set(MHA_JAX_INCLUDE_DIR "" CACHE PATH "jaxlib's FFI headers (jax.ffi.include_dir()); empty = ask Python")
set(_mha_jax_inc "${MHA_JAX_INCLUDE_DIR}")
if(NOT _mha_jax_inc AND MHA_JAX_PYTHON)
  execute_process(COMMAND "${MHA_JAX_PYTHON}" -c "import jax.ffi; print(jax.ffi.include_dir())"
                  OUTPUT_VARIABLE _mha_jax_inc RESULT_VARIABLE _mha_jax_rc
                  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT _mha_jax_rc EQUAL 0)
    set(_mha_jax_inc "")
  endif()
endif()
include(CheckLanguage)
check_language(CXX)
if(NOT EXISTS "${_mha_jax_inc}/xla/ffi/api/ffi.h")
  message(STATUS "mha: jaxlib's FFI headers not found (set MHA_JAX_INCLUDE_DIR): mha.jax not built")
elseif(NOT CMAKE_CXX_COMPILER)
  message(STATUS "mha: no C++ compiler: mha.jax not built")
else()
  enable_language(CXX)
  set(MHA_JAX_FFI_TARGET mha_jax_ffi)
  add_library(mha_jax_ffi SHARED "${CMAKE_CURRENT_LIST_DIR}/mha/_jax_ffi.cc")
  # XLA's FFI header is C++17; its own warnings are not ours (SYSTEM).
  target_include_directories(mha_jax_ffi SYSTEM PRIVATE "${_mha_jax_inc}")
  target_include_directories(mha_jax_ffi PRIVATE "${CMAKE_CURRENT_LIST_DIR}/../include")
  target_link_libraries(mha_jax_ffi PRIVATE mha_shared)
  set_target_properties(mha_jax_ffi PROPERTIES OUTPUT_NAME _jax_ffi PREFIX "" SUFFIX ".so"
                        CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON CXX_EXTENSIONS OFF
                        INSTALL_RPATH "$ORIGIN")
  # The directory's options are the C ones (-Wstrict-prototypes, ...): replaced by C++'s. Not
  # -Wpedantic: under it GCC 12 rejects the header's own declarations ("changes meaning").
  set_property(TARGET mha_jax_ffi PROPERTY COMPILE_OPTIONS -Wall -Wextra -Wshadow
               $<$<BOOL:${MHA_WERROR}>:-Werror>)
endif()

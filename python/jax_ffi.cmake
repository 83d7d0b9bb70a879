# SPDX-License-Identifier: MIT
# The XLA FFI handler of mha.jax (python/mha/_jax_ffi.cc), a plain shared library `_jax_ffi.so`
# that mha/jax.py loads with ctypes and registers with jax.ffi.register_ffi_target. Included (at
# file scope: it may enable C++) by python/CMakeLists.txt (the package) and tests/CMakeLists.txt
# (the tests' copy, found through MHA_JAX_FFI).
#   In:  MHA_JAX_PYTHON    an interpreter that imports jax, or has jaxlib installed (to find
#                          jaxlib's FFI headers: jaxlib/include/xla/ffi/api/). `pip install`
#                          builds in an isolated environment that has jaxlib (not jax) because
#                          pyproject.toml asks for it (build.requires): jaxlib is looked up
#                          without being imported.
#        MHA_JAX_INCLUDE_DIR (cache) the headers' directory, overriding the interpreter's answer
#        MHA_JAX (cache)   AUTO (default): built when the headers and a C++ compiler are found;
#                          ON: both required (a configure error otherwise); OFF: not built
#   Out: MHA_JAX_FFI_TARGET  the target name, empty when it is not built (the package then works
#                            without mha.jax, whose import says why)
# The handler links libmha (mha_shared): loaded after mha/_lib.py has loaded libmha, its
# dependency on the SONAME resolves to that same copy.
set(MHA_JAX_FFI_TARGET "")
set(MHA_JAX_INCLUDE_DIR "" CACHE PATH "jaxlib's FFI headers (jax.ffi.include_dir()); empty = ask Python")
set(MHA_JAX AUTO CACHE STRING "Build mha.jax's XLA FFI handler: AUTO, ON or OFF")
set_property(CACHE MHA_JAX PROPERTY STRINGS AUTO ON OFF)
if(MHA_JAX STREQUAL "OFF")
  message(STATUS "mha: mha.jax not built (MHA_JAX=OFF)")
  return()
endif()
set(_mha_jax_inc "${MHA_JAX_INCLUDE_DIR}")
if(NOT _mha_jax_inc AND MHA_JAX_PYTHON)
  # jaxlib's own directory, found without importing jaxlib (the headers are plain files in it):
  # the same directory that jax.ffi.include_dir() names.
  execute_process(COMMAND "${MHA_JAX_PYTHON}" -c
                  "import importlib.util, os; s = importlib.util.find_spec('jaxlib'); print(os.path.join(list(s.submodule_search_locations)[0], 'include'))"
                  OUTPUT_VARIABLE _mha_jax_inc RESULT_VARIABLE _mha_jax_rc
                  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT _mha_jax_rc EQUAL 0)
    set(_mha_jax_inc "")
  endif()
endif()
include(CheckLanguage)
check_language(CXX)
set(_mha_jax_level STATUS)
if(MHA_JAX STREQUAL "ON")
  set(_mha_jax_level FATAL_ERROR)
endif()
if(NOT EXISTS "${_mha_jax_inc}/xla/ffi/api/ffi.h")
  message(${_mha_jax_level} "mha: jaxlib's FFI headers not found (no jaxlib for ${MHA_JAX_PYTHON}; "
          "set MHA_JAX_INCLUDE_DIR): mha.jax not built")
elseif(NOT CMAKE_CXX_COMPILER)
  message(${_mha_jax_level} "mha: no C++ compiler: mha.jax not built")
else()
  message(STATUS "mha: mha.jax's XLA FFI handler built against ${_mha_jax_inc}")
  enable_language(CXX)
  set(MHA_JAX_FFI_TARGET mha_jax_ffi)
  add_library(mha_jax_ffi SHARED "${CMAKE_CURRENT_LIST_DIR}/mha/_jax_ffi.cc")
  # XLA's FFI header is C++17; its own warnings are not ours (SYSTEM).
  target_include_directories(mha_jax_ffi SYSTEM PRIVATE "${_mha_jax_inc}")
  target_link_libraries(mha_jax_ffi PRIVATE mha_shared)  # and mha.h, from its include directory
  set_target_properties(mha_jax_ffi PROPERTIES OUTPUT_NAME _jax_ffi PREFIX "" SUFFIX ".so"
                        CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON CXX_EXTENSIONS OFF
                        INSTALL_RPATH "$ORIGIN")
  # The directory's options are the C ones (-Wstrict-prototypes, ...): replaced by C++'s. Not
  # -Wpedantic: under it GCC 12 rejects the header's own declarations ("changes meaning").
  set_property(TARGET mha_jax_ffi PROPERTY COMPILE_OPTIONS -Wall -Wextra -Wshadow
               $<$<BOOL:${MHA_WERROR}>:-Werror>)
endif()

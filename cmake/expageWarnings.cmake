# expage_set_warnings(<target>): the warning set expage's own code compiles
# clean under. Applied to expage targets only, never propagated to consumers.
function(expage_set_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wconversion -Wsign-conversion
        -Wshadow -Wnon-virtual-dtor -Wold-style-cast -Wcast-align -Woverloaded-virtual
        -Wnull-dereference -Wdouble-promotion -Wimplicit-fallthrough>)
    if(EXPAGE_WARNINGS_AS_ERRORS)
      target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
    endif()
    # GCC 12 reports atomic fetch_add on a captured std::atomic as writing
    # "into a region of size 0" once ASan instruments it (a false positive of
    # -Wstringop-overflow, GCC PR 104165 family); the warning stays on elsewhere.
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND EXPAGE_SANITIZE)
      target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-stringop-overflow>)
    endif()
  endif()
  if(EXPAGE_WARNINGS_AS_ERRORS)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>)
  endif()
endfunction()

# SPDX-License-Identifier: Apache-2.0
# Debian packages, by `cpack -G DEB` in the build directory, laid out as Debian's policy asks:
#   libgradsync<ABI>      the library, named by its SONAME
#   libgradsync<ABI>-mpi  the MPI plugin, the one package that pulls in Open MPI
#   libgradsync-dev       headers, CMake and pkg-config files
#   python3-gradsync      the ctypes bindings, in /usr/lib/python3/dist-packages (Architecture: all)
# Run-time dependencies of the binaries come from dpkg-shlibdeps. scripts/ci.d/60-deb.sh builds
# them, runs lintian on them and installs them.
set(CPACK_PACKAGE_NAME gradsync)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_CONTACT "libgradsync maintainers")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "Gradient synchronisation for data-parallel training, behind a stable C ABI")
set(CPACK_RESOURCE_FILE_LICENSE ${PROJECT_SOURCE_DIR}/LICENSE)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL runtime devel python)
if(GRADSYNC_HAVE_MPI)
  list(APPEND CPACK_COMPONENTS_ALL mpi)
endif()
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME libgradsync${GRADSYNC_ABI_VERSION})
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION libs)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SHLIBDEPS ON)
set(CPACK_COMPONENT_RUNTIME_DESCRIPTION "the shared library libgradsync.so.${GRADSYNC_ABI_VERSION} (a C ABI)")
set(CPACK_DEBIAN_DEVEL_PACKAGE_NAME libgradsync-dev)
set(CPACK_COMPONENT_DEVEL_DESCRIPTION "headers, CMake package and pkg-config file")
set(CPACK_DEBIAN_DEVEL_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEVEL_PACKAGE_DEPENDS "libgradsync${GRADSYNC_ABI_VERSION} (= ${PROJECT_VERSION})")
set(CPACK_DEBIAN_MPI_PACKAGE_NAME libgradsync${GRADSYNC_ABI_VERSION}-mpi)
set(CPACK_DEBIAN_MPI_PACKAGE_SECTION libs)
set(CPACK_DEBIAN_MPI_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_MPI_PACKAGE_DEPENDS "libgradsync${GRADSYNC_ABI_VERSION} (= ${PROJECT_VERSION})")
set(CPACK_COMPONENT_MPI_DESCRIPTION "the MPI transport's plugin (links Open MPI)")
set(CPACK_DEBIAN_PYTHON_PACKAGE_NAME python3-gradsync)
set(CPACK_DEBIAN_PYTHON_PACKAGE_SECTION python)
set(CPACK_DEBIAN_PYTHON_PACKAGE_ARCHITECTURE all)
# The bindings load the library of their own version by its SONAME (scripts/gradsync/_lib.py).
set(CPACK_DEBIAN_PYTHON_PACKAGE_DEPENDS
    "python3:any, python3-numpy, libgradsync${GRADSYNC_ABI_VERSION} (= ${PROJECT_VERSION})")
set(CPACK_COMPONENT_PYTHON_DESCRIPTION "the Python bindings (ctypes)")

# Each package's copyright (machine-readable, pointing at Debian's copy of the licence), changelog
# (compressed as Debian's tools do: gzip -9n, no name, no time) and lintian overrides; the libraries'
# shlibs and an ldconfig trigger (what dh_makeshlibs writes; CPack's own shlibs would add postinst
# scripts that call ldconfig, which Debian has replaced by the trigger).
set(gradsync_deb ${PROJECT_BINARY_DIR}/debian)
file(WRITE ${gradsync_deb}/copyright
"Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: libgradsync

Files: *
Copyright: 2026 The libgradsync authors
License: Apache-2.0
 On Debian systems, the complete text of the Apache License, Version 2.0, is in
 /usr/share/common-licenses/Apache-2.0.
")
string(TIMESTAMP gradsync_deb_date "%a, %d %b %Y %H:%M:%S +0000" UTC)
file(WRITE ${gradsync_deb}/changelog
"gradsync (${PROJECT_VERSION}) unstable; urgency=medium

  * Release ${PROJECT_VERSION}; the project's history is in its version control.

 -- ${CPACK_PACKAGE_CONTACT}  ${gradsync_deb_date}
")
execute_process(COMMAND gzip -9nf ${gradsync_deb}/changelog RESULT_VARIABLE gzip_failed)
if(gzip_failed)
  message(FATAL_ERROR "gzip -9n ${gradsync_deb}/changelog failed")
endif()
set(gradsync_deb_overrides_all
"# The packages are made by cpack from an upstream release, not by a Debian maintainer, and the
# project publishes no mail address: the Maintainer field and the changelog's trailer have none.
malformed-contact
syntax-error-in-debian-changelog
")
set(gradsync_deb_ldconfig
"# CPack writes postinst and postrm scripts that call ldconfig for any library under /usr/lib
# (CPackDeb.cmake), beside the ldconfig trigger these packages declare: redundant, and harmless.
maintscript-calls-ldconfig
")
set(gradsync_deb_overrides_runtime "${gradsync_deb_ldconfig}")
set(gradsync_deb_overrides_mpi
"${gradsync_deb_ldconfig}# The plugin calls MPI and nothing of libc itself (the linker keeps only what is used); libmpi
# brings libc.
library-not-linked-against-libc
# The MPI part of libgradsync0, loaded by it, named after it (its error messages name this package);
# Debian's rule would call it libgradsync-mpi0, after the plugin's SONAME.
package-name-doesnt-match-sonames
")
foreach(component runtime devel python mpi)
  string(TOUPPER ${component} upper)
  set(package ${CPACK_DEBIAN_${upper}_PACKAGE_NAME})
  file(WRITE ${gradsync_deb}/${package}.overrides "${gradsync_deb_overrides_all}${gradsync_deb_overrides_${component}}")
  install(FILES ${gradsync_deb}/copyright ${gradsync_deb}/changelog.gz
          DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/${package} COMPONENT ${component})
  install(FILES ${gradsync_deb}/${package}.overrides DESTINATION ${CMAKE_INSTALL_DATADIR}/lintian/overrides
          RENAME ${package} COMPONENT ${component})
endforeach()
foreach(component runtime mpi)
  string(TOUPPER ${component} upper)
  set(package ${CPACK_DEBIAN_${upper}_PACKAGE_NAME})
  if(component STREQUAL "runtime")
    set(library gradsync)
  else()
    set(library gradsync-mpi)
  endif()
  file(WRITE ${gradsync_deb}/${package}/shlibs "lib${library} ${GRADSYNC_ABI_VERSION} ${package} (>= ${PROJECT_VERSION})\n")
  file(WRITE ${gradsync_deb}/${package}/triggers "activate-noawait ldconfig\n")
  set(CPACK_DEBIAN_${upper}_PACKAGE_CONTROL_EXTRA ${gradsync_deb}/${package}/shlibs ${gradsync_deb}/${package}/triggers)
endforeach()
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
include(CPack)

# SPDX-License-Identifier: Apache-2.0
# Debian packages, by `cpack -G DEB` in the build directory, laid out as Debian's policy asks:
#   libgradsync<ABI>      the library, named by its SONAME; shlibs and the ldconfig trigger
#   libgradsync<ABI>-mpi  the MPI plugin, the one package that pulls in Open MPI
#   libgradsync-dev       headers, CMake and pkg-config files
#   python3-gradsync      the ctypes bindings, in /usr/lib/python3/dist-packages (Architecture: all)
# Each carries /usr/share/doc/<package>/copyright and changelog.gz. Run-time dependencies of the
# binaries come from dpkg-shlibdeps. scripts/ci.d/60-deb.sh builds them, runs lintian, installs them.
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
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY "=")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME libgradsync${GRADSYNC_ABI_VERSION})
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION libs)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_DEVEL_PACKAGE_NAME libgradsync-dev)
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

# copyright (machine-readable, pointing at Debian's copy of the licence) and a changelog,
# compressed as Debian's tools do (gzip -9n: no name, no time), for each package.
set(gradsync_deb_doc ${PROJECT_BINARY_DIR}/debian-doc)
file(WRITE ${gradsync_deb_doc}/copyright
"Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: libgradsync

Files: *
Copyright: The libgradsync authors
License: Apache-2.0
 On Debian systems, the complete text of the Apache License, Version 2.0, is in
 /usr/share/common-licenses/Apache-2.0.
")
string(TIMESTAMP gradsync_deb_date "%a, %d %b %Y %H:%M:%S +0000" UTC)
file(WRITE ${gradsync_deb_doc}/changelog
"gradsync (${PROJECT_VERSION}) unstable; urgency=medium

  * Release ${PROJECT_VERSION}; the project's history is in its version control.

 -- ${CPACK_PACKAGE_CONTACT}  ${gradsync_deb_date}
")
execute_process(COMMAND gzip -9nf ${gradsync_deb_doc}/changelog RESULT_VARIABLE gzip_failed)
if(gzip_failed)
  message(FATAL_ERROR "gzip -9n ${gradsync_deb_doc}/changelog failed")
endif()
foreach(component runtime devel python mpi)
  string(TOUPPER ${component} upper)
  install(FILES ${gradsync_deb_doc}/copyright ${gradsync_deb_doc}/changelog.gz
          DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/${CPACK_DEBIAN_${upper}_PACKAGE_NAME} COMPONENT ${component})
endforeach()
include(CPack)

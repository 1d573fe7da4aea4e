// The translation unit of kvmesh_test_pch (tests/CMakeLists.txt), the target that builds the
// precompiled header every kvmesh_test() reuses. It has no code of its own.

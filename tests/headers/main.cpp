// The test is the build: every public header compiled alone (see BUILD.bazel).
int main() { return 0; }

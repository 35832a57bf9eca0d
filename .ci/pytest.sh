# Sourced by .ci/run and .ci/lowest-versions.
# run_pytest CMD...: run pytest; its exit status 5 (no test collected) fails CI with a message
# instead of passing for a run that tested nothing.
run_pytest() {
    local status=0
    "$@" || status=$?
    if [ "$status" -eq 5 ]; then
        echo "CI: pytest collected no tests: $*" >&2
        return 1
    fi
    return "$status"
}

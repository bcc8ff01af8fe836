// Package version holds the build's version and commit, stamped at link time by make build (from
// the VERSION file and git), else read from what the Go toolchain recorded.
package version

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// Version is the release version, set with
// -ldflags "-X github.com/ip-masq-agent/ip-masq-agent/pkg/version.Version=v1.2.3" (make build
// takes it from the VERSION file). A binary built otherwise says "dev", or the module version
// that `go install ...@v1.2.3` recorded.
var Version = "dev"

// Commit is the git commit, with "-dirty" when the tree had changes, set with -ldflags "-X
// .../pkg/version.Commit=..." by make build. Empty means: what Go recorded (vcs.revision).
var Commit = ""

// unknown is the revision of a build that recorded none (the build_info metric's label).
const unknown = "unknown"

// Revision returns the commit the binary was built from, or "unknown" when the build recorded
// none.
func Revision() string {
	rev, _ := revision(readBuildInfo(), Commit)
	return rev
}

// String is the one-line description `ip-masq-agent version` prints.
func String() string {
	info := readBuildInfo()
	rev, recorded := revision(info, Commit)
	commit := "commit " + rev
	if !recorded {
		// Go records the revision only for go build (not go run or go test) in a git checkout
		// of its own (a worktree's .git is a file, which it does not follow), with -buildvcs
		// not false (as a GOFLAGS in `go env` may set it).
		commit = "commit not recorded: built without make build, and the Go toolchain recorded none " +
			"(go run, go build -buildvcs=false, a git worktree or a tree outside git)"
	}
	return fmt.Sprintf("ip-masq-agent %s (%s, %s, %s/%s)", version(info, Version), commit, runtime.Version(), runtime.GOOS, runtime.GOARCH)
}

func readBuildInfo() *debug.BuildInfo {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return nil
	}
	return info
}

// revision is the stamped commit, else the one Go recorded (with -dirty when the tree was
// modified); false when there is neither.
func revision(info *debug.BuildInfo, stamped string) (string, bool) {
	if stamped != "" {
		return stamped, true
	}
	if info == nil {
		return unknown, false
	}
	rev, dirty := "", false
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if rev == "" {
		return unknown, false
	}
	if dirty {
		rev += "-dirty"
	}
	return rev, true
}

// version is the stamped version, else the module version Go recorded for `go install
// module@version` (a build inside the module records "(devel)").
func version(info *debug.BuildInfo, stamped string) string {
	if stamped != "dev" || info == nil || info.Main.Version == "" || info.Main.Version == "(devel)" {
		return stamped
	}
	return info.Main.Version
}

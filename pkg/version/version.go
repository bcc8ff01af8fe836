// Package version holds the build's version, stamped at link time.
package version

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// Version is set with -ldflags "-X github.com/ip-masq-agent/ip-masq-agent/pkg/version.Version=v1.2.3".
var Version = "dev"

// Revision returns the VCS commit the binary was built from, when Go recorded it.
func Revision() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	rev, dirty := "unknown", false
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if dirty {
		rev += "-dirty"
	}
	return rev
}

// String is the one-line description `ip-masq-agent version` prints.
func String() string {
	return fmt.Sprintf("ip-masq-agent %s (commit %s, %s, %s/%s)", Version, Revision(), runtime.Version(), runtime.GOOS, runtime.GOARCH)
}

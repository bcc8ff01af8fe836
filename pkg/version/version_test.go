package version

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
	"time"
)

func TestRevision(t *testing.T) {
	vcs := func(kv ...string) *debug.BuildInfo {
		info := &debug.BuildInfo{}
		for i := 0; i < len(kv); i += 2 {
			info.Settings = append(info.Settings, debug.BuildSetting{Key: kv[i], Value: kv[i+1]})
		}
		return info
	}
	for _, tt := range []struct {
		name     string
		info     *debug.BuildInfo
		stamped  string
		want     string
		recorded bool
	}{
		{"stamped by make build", vcs("vcs.revision", "aaa"), "bbb-dirty", "bbb-dirty", true},
		{"recorded by go build", vcs("vcs.revision", "aaa", "vcs.modified", "false"), "", "aaa", true},
		{"recorded, modified tree", vcs("vcs.revision", "aaa", "vcs.modified", "true"), "", "aaa-dirty", true},
		{"go build -buildvcs=false", vcs("-trimpath", "true"), "", unknown, false},
		{"no build info", nil, "", unknown, false},
	} {
		if got, recorded := revision(tt.info, tt.stamped); got != tt.want || recorded != tt.recorded {
			t.Errorf("%s: %q %v, want %q %v", tt.name, got, recorded, tt.want, tt.recorded)
		}
	}
	if got := version(&debug.BuildInfo{Main: debug.Module{Version: "v1.2.3"}}, "dev"); got != "v1.2.3" {
		t.Errorf("go install @v1.2.3: version %q", got)
	}
	if got := version(&debug.BuildInfo{Main: debug.Module{Version: "(devel)"}}, "dev"); got != "dev" {
		t.Errorf("go build in the module: version %q", got)
	}
	if got := version(&debug.BuildInfo{Main: debug.Module{Version: "v1.2.3"}}, "v1.3.0"); got != "v1.3.0" {
		t.Errorf("stamped: version %q", got)
	}
}

// The agent built the two ways a developer does: `make build` records the VERSION file and the
// checkout's commit, whatever Go's VCS stamping does (a worktree, GOFLAGS=-buildvcs=false);
// `go build` without stamping says that the commit was not recorded, and why, instead of
// "commit unknown".
func TestBuiltVersion(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the agent")
	}
	for _, tool := range []string{"go", "git", "make"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is needed to build the agent: %v", tool, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	root := filepath.Join("..", "..")
	dir := t.TempDir()
	run := func(name string, args ...string) string {
		t.Helper()
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Dir = root
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
		return strings.TrimSpace(string(out))
	}
	release, err := os.ReadFile(filepath.Join(root, "VERSION"))
	if err != nil {
		t.Fatal(err)
	}
	head := run("git", "rev-parse", "HEAD")

	made := filepath.Join(dir, "made")
	run("make", "-s", "build", "BIN="+made)
	got := run(made, "version")
	if want := "ip-masq-agent " + strings.TrimSpace(string(release)) + " (commit " + head; !strings.HasPrefix(got, want) {
		t.Errorf("make build: %q, want it to start with %q", got, want)
	}

	plain := filepath.Join(dir, "plain")
	run("go", "build", "-buildvcs=false", "-o", plain, "./cmd/ip-masq-agent")
	got = run(plain, "version")
	if !strings.Contains(got, "commit not recorded") || !strings.Contains(got, "-buildvcs=false") || strings.Contains(got, "unknown") {
		t.Errorf("go build -buildvcs=false: %q, want it to say that the commit was not recorded, and why", got)
	}
}

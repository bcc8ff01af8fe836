package testutil

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
)

// RepoRoot is the repository's root: the nearest directory at or above the working directory
// whose go.mod is the project's (go test runs a test in its package's directory; the nested
// tools module of test/cluster/k8s is passed over).
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && strings.HasPrefix(string(b), "module github.com/ip-masq-agent/ip-masq-agent\n") {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("not inside the ip-masq-agent repository")
		}
		dir = parent
	}
}

package cluster

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// BinEnv names the directory of the Kubernetes binaries when they are not where `make k8s`
// puts them.
const BinEnv = "IP_MASQ_AGENT_K8S_BIN"

// toolsModule is the module that pins the Kubernetes release (test/cluster/k8s/go.mod), relative
// to the repository's root.
const toolsModule = "test/cluster/k8s/go.mod"

// Binaries finds the Kubernetes components: $IP_MASQ_AGENT_K8S_BIN, or bin/k8s/VERSION of the
// repository, VERSION being k8s.io/kubernetes's in the tools module, where `make k8s` builds
// them. The error says how to build them.
func Binaries() (string, error) {
	return findBinaries("make k8s builds the Kubernetes components",
		"kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy", "kubectl")
}

// findBinaries returns the directory of the Kubernetes binaries ($IP_MASQ_AGENT_K8S_BIN or
// bin/k8s/VERSION) once every named one is in it; the error of a missing one ends with how.
func findBinaries(how string, names ...string) (string, error) {
	dir := os.Getenv(BinEnv)
	if dir == "" {
		root, err := RepoRoot()
		if err != nil {
			return "", err
		}
		version, err := KubernetesVersion(root)
		if err != nil {
			return "", err
		}
		dir = filepath.Join(root, "bin", "k8s", version)
	}
	for _, name := range names {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			return "", fmt.Errorf("no %s in %s (%s): %w", name, dir, how, err)
		}
	}
	return dir, nil
}

// RepoRoot is the repository's root (testutil.RepoRoot).
func RepoRoot() (string, error) { return testutil.RepoRoot() }

// KubernetesVersion is the Kubernetes release the tools module builds.
func KubernetesVersion(root string) (string, error) {
	return requiredVersion(filepath.Join(root, toolsModule), "k8s.io/kubernetes")
}

// requiredVersion is the version of module that the go.mod file at path requires.
func requiredVersion(path, module string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(strings.TrimPrefix(strings.TrimSpace(sc.Text()), "require "))
		if len(fields) >= 2 && fields[0] == module {
			return fields[1], nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	return "", fmt.Errorf("%s requires no %s", path, module)
}

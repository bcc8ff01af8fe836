// Package container runs the agent's image in a real container runtime (podman with runc), the
// way its DaemonSet runs it: the security context, arguments, environment, mounts and probes
// are read from the manifests under deploy/, and the container's host network is a throwaway
// node namespace of an e2e topology (pod -> node -> external host).
package container

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Podman is a podman with a store, a state, a network configuration and a configuration of its
// own, in a directory the tests remove: nothing of the host's podman (its images, containers or
// networks) is used or changed.
type Podman struct {
	dir string
}

// NewPodman prepares a podman under dir. The configuration is what works on any host this
// suite runs on: runc (Debian's crun refuses some hybrid cgroup layouts), cgroupfs (no systemd
// needed), file events and logs (no journald), and ulimits that this process holds, since podman's root
// default (nofile=1048576) fails where the hard limit is lower (setrlimit: operation not
// permitted).
func NewPodman(dir string) (*Podman, error) {
	var nofile, nproc unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &nofile); err != nil {
		return nil, err
	}
	if err := unix.Getrlimit(unix.RLIMIT_NPROC, &nproc); err != nil {
		return nil, err
	}
	// podman lowers its own RLIMIT_NPROC to kernel.pid_max, and a container cannot get more.
	if data, err := os.ReadFile("/proc/sys/kernel/pid_max"); err == nil {
		if max, err := strconv.ParseUint(strings.TrimSpace(string(data)), 10, 64); err == nil && max < nproc.Max {
			nproc.Max = max
		}
	}
	conf := fmt.Sprintf(`[containers]
default_ulimits = ["nofile=%d:%d", "nproc=%d:%d"]
log_driver = "k8s-file"
# No network unless a test names one (a node namespace): podman's default bridge would change
# the host's namespace (a bridge, addresses, forwarding, firewall rules).
netns = "none"

[network]
network_config_dir = %q

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
`, nofile.Max, nofile.Max, nproc.Max, nproc.Max, filepath.Join(dir, "networks"))
	if err := os.WriteFile(filepath.Join(dir, "containers.conf"), []byte(conf), 0o644); err != nil {
		return nil, err
	}
	return &Podman{dir: dir}, nil
}

// Command is a podman command on this store.
func (p *Podman) Command(ctx context.Context, args ...string) *exec.Cmd {
	global := []string{"--root", filepath.Join(p.dir, "root"), "--runroot", filepath.Join(p.dir, "run"),
		"--tmpdir", filepath.Join(p.dir, "tmp"), "--storage-driver", "overlay"}
	cmd := exec.CommandContext(ctx, "podman", append(global, args...)...)
	cmd.Env = append(os.Environ(), "CONTAINERS_CONF="+filepath.Join(p.dir, "containers.conf"))
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// Run runs a podman command and returns its standard output; an error carries its standard
// error.
func (p *Podman) Run(ctx context.Context, args ...string) (string, error) {
	cmd := p.Command(ctx, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("podman %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

// Logs returns what a container wrote, its standard output and error in order (podman logs
// splits them again into its own two streams).
func (p *Podman) Logs(ctx context.Context, name string) (string, error) {
	out, err := p.Command(ctx, "logs", name).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("podman logs %s: %w", name, err)
	}
	return string(out), nil
}

// Inspect reads one field of a container or an image with a Go template, e.g. {{.State.Pid}}.
func (p *Podman) Inspect(ctx context.Context, name, format string) (string, error) {
	out, err := p.Run(ctx, "inspect", "--format", format, name)
	return strings.TrimSpace(out), err
}

// Reset removes every container and image of the store, so that the directory can go.
func (p *Podman) Reset(ctx context.Context) error {
	if _, err := p.Run(ctx, "rm", "--all", "--force", "--time=0"); err != nil {
		return err
	}
	_, err := p.Run(ctx, "rmi", "--all", "--force")
	return err
}

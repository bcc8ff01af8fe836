package container

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// Sources are what the test gives the pod's volumes on this host, in place of the node's.
type Sources struct {
	// HostPaths maps a hostPath volume's path to the test's file or directory.
	HostPaths map[string]string
	// ConfigMaps maps a ConfigMap's name to a directory ProjectConfigMap filled.
	ConfigMaps map[string]string
}

// Run says how to run one container of a pod spec.
type Run struct {
	Name  string
	Image string
	// NetNS is the network namespace (a /run/netns name) that stands for the node's: the pod
	// must use the host network.
	NetNS string
	// Seccomp is podman's --security-opt seccomp= value for the profile the pod asks for, ""
	// for podman's default. The caller decides what RuntimeDefault means (see Profile).
	Seccomp string
	Sources Sources
	// Labels are the pod's, as its controller made it (the DaemonSet's: the template's and
	// pod-template-generation), for the environment's label references.
	Labels map[string]string
}

// Profile is the seccomp profile a container of the pod runs under: its own, else the pod's.
func Profile(spec corev1.PodSpec, c corev1.Container) *corev1.SeccompProfile {
	if c.SecurityContext != nil && c.SecurityContext.SeccompProfile != nil {
		return c.SecurityContext.SeccompProfile
	}
	if spec.SecurityContext != nil {
		return spec.SecurityContext.SeccompProfile
	}
	return nil
}

// PodmanArgs returns the `podman create` arguments that run container c of the pod as the
// kubelet would, as far as podman expresses it: host network, capabilities, no privilege
// escalation, a read-only root (without the tmpfs mounts podman adds by default, which a pod
// does not have), the user, seccomp, resources, the environment (resource and label
// references resolved; its variables expanded in the command and arguments), every volume
// mount with its propagation, the command and arguments, the grace period. A field it cannot
// express is an error, so that a change to the manifest is noticed.
func PodmanArgs(spec corev1.PodSpec, c corev1.Container, r Run) ([]string, error) {
	if !spec.HostNetwork {
		return nil, fmt.Errorf("the pod does not use the host network")
	}
	args := []string{"create", "--name", r.Name, "--pull=never", "--network", "ns:/run/netns/" + r.NetNS}
	sc := c.SecurityContext
	if sc == nil {
		return nil, fmt.Errorf("container %s has no securityContext", c.Name)
	}
	if sc.Privileged != nil && *sc.Privileged {
		return nil, fmt.Errorf("container %s is privileged", c.Name)
	}
	if sc.Capabilities != nil {
		for _, d := range sc.Capabilities.Drop {
			args = append(args, "--cap-drop="+strings.ToLower(string(d)))
		}
		for _, a := range sc.Capabilities.Add {
			args = append(args, "--cap-add="+string(a))
		}
	}
	// Kubernetes' default is true; false is no_new_privs.
	if sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation {
		args = append(args, "--security-opt=no-new-privileges")
	}
	if sc.ReadOnlyRootFilesystem != nil && *sc.ReadOnlyRootFilesystem {
		args = append(args, "--read-only", "--read-only-tmpfs=false")
	}
	user := runAs(spec.SecurityContext, sc)
	if user != "" {
		args = append(args, "--user", user)
	}
	if r.Seccomp != "" {
		args = append(args, "--security-opt", "seccomp="+r.Seccomp)
	}
	res, err := resources(c.Resources)
	if err != nil {
		return nil, err
	}
	args = append(args, res...)
	vars := map[string]string{}
	for _, e := range c.Env {
		v, err := envValue(c, e, r.Labels)
		if err != nil {
			return nil, err
		}
		args = append(args, "--env", e.Name+"="+v)
		vars[e.Name] = v
	}
	mounts, err := mounts(spec, c, r.Sources)
	if err != nil {
		return nil, err
	}
	args = append(args, mounts...)
	if spec.TerminationGracePeriodSeconds != nil {
		args = append(args, "--stop-timeout", strconv.FormatInt(*spec.TerminationGracePeriodSeconds, 10))
	}
	if len(c.Command) > 0 {
		ep, err := json.Marshal(expandAll(c.Command, vars))
		if err != nil {
			return nil, err
		}
		args = append(args, "--entrypoint", string(ep))
	}
	args = append(args, r.Image)
	return append(args, expandAll(c.Args, vars)...), nil
}

// varRef is a $(NAME) reference of a command or an argument, or the $$ that escapes one.
var varRef = regexp.MustCompile(`\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// expandAll expands the references to the container's variables in args as the kubelet does:
// $(NAME) is NAME's value, $$ a $, and a reference to no variable stays as written.
func expandAll(args []string, vars map[string]string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = varRef.ReplaceAllStringFunc(a, func(ref string) string {
			if ref == "$$" {
				return "$"
			}
			if v, ok := vars[ref[2:len(ref)-1]]; ok {
				return v
			}
			return ref
		})
	}
	return out
}

func runAs(pod *corev1.PodSecurityContext, c *corev1.SecurityContext) string {
	var uid, gid *int64
	if pod != nil {
		uid, gid = pod.RunAsUser, pod.RunAsGroup
	}
	if c.RunAsUser != nil {
		uid = c.RunAsUser
	}
	if c.RunAsGroup != nil {
		gid = c.RunAsGroup
	}
	switch {
	case uid == nil:
		return ""
	case gid == nil:
		return strconv.FormatInt(*uid, 10)
	}
	return fmt.Sprintf("%d:%d", *uid, *gid)
}

// resources are the limits and the CPU request as the kubelet sets them in the cgroup: the
// memory limit, CPU shares of 1024 per CPU requested (2 at least), a CPU quota for a CPU
// limit. (The memory request is the scheduler's, and no cgroup setting.)
func resources(r corev1.ResourceRequirements) ([]string, error) {
	var out []string
	for name, q := range r.Limits {
		switch name {
		case corev1.ResourceMemory:
			out = append(out, fmt.Sprintf("--memory=%d", q.Value()))
		case corev1.ResourceCPU:
			out = append(out, fmt.Sprintf("--cpus=%.3f", float64(q.MilliValue())/1000))
		default:
			return nil, fmt.Errorf("limit of %s: not run here", name)
		}
	}
	for name, q := range r.Requests {
		switch name {
		case corev1.ResourceCPU:
			out = append(out, fmt.Sprintf("--cpu-shares=%d", max(2, q.MilliValue()*1024/1000)))
		case corev1.ResourceMemory:
		default:
			return nil, fmt.Errorf("request of %s: not run here", name)
		}
	}
	return out, nil
}

// envValue is a variable's value as the kubelet sets it: literal, a label of the pod (empty
// when it has none), or a resource of the container divided by the divisor (1 by default),
// rounded up.
func envValue(c corev1.Container, e corev1.EnvVar, labels map[string]string) (string, error) {
	if e.ValueFrom == nil {
		return e.Value, nil
	}
	if f := e.ValueFrom.FieldRef; f != nil {
		m := labelRef.FindStringSubmatch(f.FieldPath)
		if m == nil {
			return "", fmt.Errorf("env %s: field %s: only the pod's labels are run here", e.Name, f.FieldPath)
		}
		return labels[m[1]], nil
	}
	ref := e.ValueFrom.ResourceFieldRef
	if ref == nil || (ref.ContainerName != "" && ref.ContainerName != c.Name) {
		return "", fmt.Errorf("env %s: only resource references to the container itself are run here", e.Name)
	}
	var q resource.Quantity
	switch ref.Resource {
	case "limits.memory":
		q = c.Resources.Limits[corev1.ResourceMemory]
	case "requests.memory":
		q = c.Resources.Requests[corev1.ResourceMemory]
	case "limits.cpu":
		q = c.Resources.Limits[corev1.ResourceCPU]
	case "requests.cpu":
		q = c.Resources.Requests[corev1.ResourceCPU]
	default:
		return "", fmt.Errorf("env %s: resource %s not run here", e.Name, ref.Resource)
	}
	if q.IsZero() {
		return "", fmt.Errorf("env %s: %s is not set (the kubelet would use the node's allocatable)", e.Name, ref.Resource)
	}
	divisor := ref.Divisor
	if divisor.IsZero() {
		divisor = resource.MustParse("1")
	}
	v := (q.MilliValue() + divisor.MilliValue() - 1) / divisor.MilliValue()
	return strconv.FormatInt(v, 10), nil
}

// labelRef is a field path to one of the pod's labels.
var labelRef = regexp.MustCompile(`^metadata\.labels\['([^']+)'\]$`)

// mounts binds each volume mount's source, read-only where asked, with its propagation.
func mounts(spec corev1.PodSpec, c corev1.Container, src Sources) ([]string, error) {
	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
	}
	var out []string
	for _, m := range c.VolumeMounts {
		v, ok := volumes[m.Name]
		if !ok {
			return nil, fmt.Errorf("mount %s has no volume", m.Name)
		}
		if m.SubPath != "" || m.SubPathExpr != "" {
			return nil, fmt.Errorf("mount %s: subPath not run here", m.Name)
		}
		var from string
		switch {
		case v.HostPath != nil:
			from = src.HostPaths[v.HostPath.Path]
			if from == "" {
				return nil, fmt.Errorf("volume %s: no test source for hostPath %s", v.Name, v.HostPath.Path)
			}
			if err := checkHostPath(from, v.HostPath.Type); err != nil {
				return nil, fmt.Errorf("volume %s: %w", v.Name, err)
			}
		case v.ConfigMap != nil:
			from = src.ConfigMaps[v.ConfigMap.Name]
			if from == "" {
				return nil, fmt.Errorf("volume %s: no projection of ConfigMap %s", v.Name, v.ConfigMap.Name)
			}
		default:
			return nil, fmt.Errorf("volume %s: only hostPath and configMap volumes are run here", v.Name)
		}
		propagation := "rprivate"
		if m.MountPropagation != nil {
			switch *m.MountPropagation {
			case corev1.MountPropagationHostToContainer:
				propagation = "rslave"
			case corev1.MountPropagationBidirectional:
				propagation = "rshared"
			}
		}
		opt := fmt.Sprintf("type=bind,source=%s,destination=%s,bind-propagation=%s", from, m.MountPath, propagation)
		if m.ReadOnly {
			opt += ",ro=true"
		}
		out = append(out, "--mount", opt)
	}
	return out, nil
}

// checkHostPath checks a source as the kubelet checks the volume's type (creating it for
// FileOrCreate and DirectoryOrCreate).
func checkHostPath(path string, typ *corev1.HostPathType) error {
	t := corev1.HostPathUnset
	if typ != nil {
		t = *typ
	}
	switch t {
	case corev1.HostPathFileOrCreate:
		f, err := os.OpenFile(path, os.O_CREATE|os.O_RDONLY, 0o644)
		if err != nil {
			return err
		}
		return f.Close()
	case corev1.HostPathDirectoryOrCreate:
		return os.MkdirAll(path, 0o755)
	case corev1.HostPathDirectory, corev1.HostPathFile:
		st, err := os.Stat(path)
		if err != nil {
			return err
		}
		if st.IsDir() != (t == corev1.HostPathDirectory) {
			return fmt.Errorf("%s is not a %s", path, t)
		}
	}
	return nil
}

// ProjectConfigMap writes a ConfigMap volume into dir as the kubelet does: the files in a
// timestamped directory, ..data linked to it, and each item's path linked through ..data.
func ProjectConfigMap(dir string, cm *corev1.ConfigMap, v *corev1.ConfigMapVolumeSource) error {
	items := v.Items
	if len(items) == 0 {
		for k := range cm.Data {
			items = append(items, corev1.KeyToPath{Key: k, Path: k})
		}
	}
	const ts = "..2026_01_01_00_00_00.000000001"
	for _, it := range items {
		if strings.Contains(it.Path, "/") {
			return fmt.Errorf("item path %s: only top-level paths are projected here", it.Path)
		}
		data, ok := cm.Data[it.Key]
		if !ok {
			if v.Optional != nil && *v.Optional {
				continue
			}
			return fmt.Errorf("ConfigMap %s has no key %s", cm.Name, it.Key)
		}
		file := filepath.Join(dir, ts, it.Path)
		if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(file, []byte(data), 0o644); err != nil {
			return err
		}
		if err := os.Symlink(filepath.Join("..data", it.Path), filepath.Join(dir, it.Path)); err != nil {
			return err
		}
	}
	return os.Symlink(ts, filepath.Join(dir, "..data"))
}

// ProbeURL is the URL of an HTTP probe of a host-network pod, inside the node's namespace.
func ProbeURL(c corev1.Container, p *corev1.Probe) (string, error) {
	if p == nil || p.HTTPGet == nil {
		return "", fmt.Errorf("container %s: not an HTTP probe: %+v", c.Name, p)
	}
	port := p.HTTPGet.Port.IntValue()
	if name := p.HTTPGet.Port.StrVal; name != "" {
		for _, cp := range c.Ports {
			if cp.Name == name {
				port = int(cp.ContainerPort)
			}
		}
	}
	if port == 0 {
		return "", fmt.Errorf("container %s: probe port %s not found", c.Name, p.HTTPGet.Port.String())
	}
	scheme := "http"
	if p.HTTPGet.Scheme == corev1.URISchemeHTTPS {
		scheme = "https"
	}
	return fmt.Sprintf("%s://%s%s", scheme, net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), p.HTTPGet.Path), nil
}
